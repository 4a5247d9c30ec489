"""The compute figures of one rank: matmul rates, memory bandwidth, the host side of offload,
elementwise and special-function kernels, attention, and the per-kernel floor."""
from __future__ import annotations

from typing import Any, Callable

import torch

from autoshard.tools.calibrate.timing import Sizes, timed


def measure_matmuls(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """A linear layer per shape as a training step runs it: the forward ``x·Wᵀ`` recorded by
    autograd, and the backward autograd runs for it (``torch.autograd.grad`` of the output:
    the input gradient ``dy·W`` and the weight gradient ``dyᵀ·x``, with the layouts, copies and
    engine work a step pays), timed as forward + backward less the forward."""
    import torch.nn.functional as F
    out = []
    for m, k, n in sizes.matmul:
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        flops = 2.0 * m * k * n
        forward = timed(lambda: F.linear(x, w), device, sizes)
        both = timed(lambda: torch.autograd.grad(F.linear(x, w), (x, w), dy), device, sizes)
        out.append({"shape": [m, k, n], "flops": flops, "forward_s": forward,
                    # noise can leave a tiny difference: at most twice the forward's rate
                    "backward_s": max(both - forward, forward)})
    return out


def measure_bandwidth(sizes: Sizes, device: torch.device) -> dict:
    n = sizes.copy_bytes // 4
    a = torch.randn(n, device=device)
    b = torch.randn(n, device=device)
    c = torch.empty(n, device=device)
    copy_s = timed(lambda: c.copy_(a), device, sizes)
    add_s = timed(lambda: torch.add(a, b, out=c), device, sizes)
    del a, b, c
    return {"bytes_per_tensor": n * 4, "copy_s": copy_s, "copy_bytes_per_s": 2 * n * 4 / copy_s,
            "add_s": add_s, "add_bytes_per_s": 3 * n * 4 / add_s}


def measure_host_side(sizes: Sizes, device: torch.device) -> dict:
    """Optimizer offload's host figures (docs/cost-model.md §2.10), every rank at once as they
    share the host in training: codegen/hostopt.py's AdamW step over ``host_state_bytes`` of
    fp32 state, its gradient landed as training lands it (from the GPU in bf16, pinned; on a
    CPU run a host copy of the fp32 gradient); in the model's terms, 28 bytes an element per
    second, the gradient's copy down the link taken out (it is priced at ``host_bandwidth``).
    On a GPU, pinned copies of ``copy_bytes`` each way."""
    from autoshard.codegen.hostopt import HostOptimizer
    n = sizes.host_state_bytes // 12
    master = torch.nn.Parameter(torch.randn(n))
    grad = torch.randn(n, device=device,
                       dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    host = HostOptimizer(torch.optim.AdamW([master], lr=1e-3), "adam", [0], [master],
                         [torch.float32], overlap="none", bucket_bytes=25 * 2**20,
                         device=device)

    def step() -> None:
        host.land(0, grad)
        host.start([], _dropped)
        host.finish(_dropped)

    t = timed(step, device, sizes)
    host.close()
    out: dict[str, Any] = {"state_bytes": 12 * n, "step_s": t}
    link_s = 0.0
    if device.type == "cuda":
        m = sizes.copy_bytes // 4
        pinned = torch.empty(m, pin_memory=True)
        dev = torch.empty(m, device=device)
        h2d = timed(lambda: dev.copy_(pinned, non_blocking=True), device, sizes)
        d2h = timed(lambda: pinned.copy_(dev, non_blocking=True), device, sizes)
        out.update(h2d_bytes_per_s=4 * m / h2d, d2h_bytes_per_s=4 * m / d2h)
        link_s = n * grad.element_size() / out["d2h_bytes_per_s"]
        del pinned, dev
    out["adam_bytes_per_s"] = 28 * n / max(t - link_s, 1e-12)
    return out


def _dropped(key: Any, new: torch.Tensor) -> None:
    """(a calibration step's updated parameters go nowhere)"""


def measure_elementwise(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Op-sized elementwise kernels: bytes read + written per second (§3.1's count)."""
    import torch.nn.functional as F
    x = torch.randn(*sizes.elementwise_shape, device=device, dtype=dtype)
    y = torch.randn_like(x)
    nb = x.numel() * x.element_size()
    h = sizes.elementwise_shape[-1]
    ops = {"add": (lambda: x + y, 3 * nb),
           "gelu_tanh": (lambda: F.gelu(x, approximate="tanh"), 2 * nb),
           "layer_norm": (lambda: F.layer_norm(x, (h,)), 2 * nb),
           "softmax": (lambda: torch.softmax(x, -1), 2 * nb)}
    out: dict[str, Any] = {"shape": list(x.shape), "dtype": str(dtype).removeprefix("torch.")}
    total_b = total_s = 0.0
    for name, (fn, moved) in ops.items():
        t = timed(fn, device, sizes)
        out[name] = {"s": t, "bytes_per_s": moved / t}
        total_b, total_s = total_b + moved, total_s + t
    out["overall_bytes_per_s"] = total_b / total_s      # the four kernels back to back
    return out


def _special_kernels(x: torch.Tensor) -> dict[str, tuple[Callable[[], Any], int]]:
    """The special-function kernels of transformer training, forward and backward, each with
    its evaluations per element as the cost model counts them (autoshard/cost/compute.py
    ``SPECIALS``, docs/cost-model.md §3.7): the activations (GELU in both forms, SiLU) and the
    softmaxes (attention's, the loss's log-softmax), through the ATen kernels autograd runs."""
    import torch.nn.functional as F
    aten = torch.ops.aten
    g = torch.randn_like(x)
    y = torch.softmax(x, -1)
    ly = torch.log_softmax(x, -1)
    return {
        "gelu_tanh": (lambda: F.gelu(x, approximate="tanh"), 1),
        "gelu_tanh_backward": (lambda: aten.gelu_backward(g, x, approximate="tanh"), 1),
        "gelu_erf": (lambda: F.gelu(x), 1),
        "gelu_erf_backward": (lambda: aten.gelu_backward(g, x), 2),
        "silu": (lambda: F.silu(x), 1),
        "silu_backward": (lambda: aten.silu_backward(g, x), 1),
        "softmax": (lambda: torch.softmax(x, -1), 1),
        "log_softmax": (lambda: torch.log_softmax(x, -1), 1),
        "log_softmax_backward": (lambda: aten._log_softmax_backward_data(g, ly, -1, x.dtype), 1),
        "exp": (lambda: torch.exp(y), 1),
        "tanh": (lambda: torch.tanh(x), 1),
    }


def measure_specials(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Special-function evaluations per second (§3.7): every kernel of ``_special_kernels`` on
    an op-sized activation, evaluations over time, per kernel and over all of them (total
    evaluations over total time, the rate the model prices them at)."""
    x = torch.randn(*sizes.elementwise_shape, device=device, dtype=dtype)
    out: dict[str, Any] = {"shape": list(x.shape), "dtype": str(dtype).removeprefix("torch.")}
    evals = secs = 0.0
    for name, (fn, per) in _special_kernels(x).items():
        t = timed(fn, device, sizes)
        n = per * x.numel()
        out[name] = {"s": t, "per_element": per, "evals_per_s": n / t}
        evals, secs = evals + n, secs + t
    out["overall_evals_per_s"] = evals / secs
    return out


def measure_attention(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Causal SDPA forward and forward + backward. FLOPs as the model counts them (§3.4:
    ``4·batch·heads·L²·d``, halved for the causal mask; backward 2.5× forward, §3.5)."""
    import torch.nn.functional as F
    b, h, s, d = sizes.attention
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    flops = 4.0 * b * h * s * s * d / 2

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    with torch.no_grad():
        tf = timed(fwd, device, sizes)
    tfb = timed(fwd_bwd, device, sizes)
    return {"shape": [b, h, s, d], "dtype": str(dtype).removeprefix("torch."), "flops": flops,
            "forward_s": tf, "forward_backward_s": tfb,
            "forward_flops_per_s": flops / tf,
            # the model's training FLOPs (1 + 2.5) x forward, over the measured time
            "training_flops_per_s": 3.5 * flops / tfb}


def measure_kernel_floor(sizes: Sizes, device: torch.device) -> dict:
    """A tiny op alone, and a chain of tiny ops forward + backward (per kernel)."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    n = sizes.tiny_chain
    bare = timed(lambda: torch.add(a, b), device, sizes)
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(n):
            y = y * 1.0001
        y.backward()

    per_kernel = timed(chain, device, sizes) / (2 * n)
    program = program_chain(n)

    def program_step():
        program(x, b).backward()

    per_op = timed(program_step, device, sizes) / (2 * n)
    return {"bare_op_s": bare, "autograd_per_kernel_s": per_kernel,
            "program_per_op_s": per_op, "chain": n}


def program_chain(n: int) -> "torch.fx.GraphModule":
    """``n`` ATen multiplications as an FX GraphModule, as the eager rank program runs its ops
    (codegen/rewrite.py: generated Python calling ATen overloads): its time per op forward and
    backward on tiny tensors is the host's dispatch of one op (``host_dispatch_s``), where the
    device is faster than the host (a GPU; on a CPU the host is the device)."""
    import torch.fx as fx
    g = fx.Graph()
    y, c = g.placeholder("x"), g.placeholder("c")
    for _ in range(n):
        y = g.call_function(torch.ops.aten.mul.Tensor, (y, c))
    g.output(g.call_function(torch.ops.aten.sum.default, (y,)))
    return fx.GraphModule(torch.nn.Module(), g)

