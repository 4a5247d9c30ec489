"""The user's tools on top of the planner: the command line (`cli`), proving a plan on gloo ranks
(`verify`), measuring this machine into a cluster profile (`calibrate`), why a plan decides as it
does (`explain`), comparing two plans (`diff`), a plan as one HTML page (`report`) and a plan as
PyTorch code (`export`). Nothing below this package imports it (tests/test_layering.py)."""
