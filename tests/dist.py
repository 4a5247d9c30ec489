"""The tests' multi-process harness lives in the package (``autoshard verify`` uses it too)."""
from autoshard.codegen.world import RankCrash, RankError, World, world_fixture

__all__ = ["RankCrash", "RankError", "World", "world_fixture"]
