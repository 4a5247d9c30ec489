"""The counter-based generator materialisation draws from (codegen/materialize.py): the value
at flat index ``i`` of a tensor is a pure function of (seed, the tensor's name, the draw's
number, ``i``), so a rank computes its own indices and nothing else and every shard equals the
same slice of the whole tensor, bit for bit (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011; the hash is splitmix64, Steele, Lea & Flood, OOPSLA 2014).""" 
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15          # splitmix64's increment (2^64 / golden ratio)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (the reference the tensor version must equal)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; multiplication wraps modulo 2^64."""
    x = (x ^ _srl(x, 30)) * _signed(_MIX1)
    x = (x ^ _srl(x, 27)) * _signed(_MIX2)
    return x ^ _srl(x, 31)


def stream_key(seed: int, name: str, draw: int) -> int:
    """The 64-bit key of draw number ``draw`` into tensor ``name`` under ``seed``."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return _mix_int(_mix_int(seed ^ h) + (draw + 1) * _GOLDEN)


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """64 random bits (int64) per flat index: splitmix64's output number ``index + 1`` of the
    stream whose state starts at ``key``; element ``i`` needs nothing but ``i``."""
    state = (index + 1) * _signed(_GOLDEN) + _signed(key)
    return _mix(state)


def _uniform01(key: int, index: torch.Tensor) -> torch.Tensor:
    """float64 uniform on (0, 1): the top 53 bits, centred in their cell (never 0 or 1)."""
    return (_srl(random_bits(key, index), 11).to(torch.float64) + 0.5) * 2.0 ** -53


def counter_uniform(seed: int, name: str, index: torch.Tensor, *, low: float = 0.0,
                    high: float = 1.0, draw: int = 0) -> torch.Tensor:
    """float64 values uniform on [low, high), one per element of the int64 ``index`` tensor,
    each a pure function of (seed, name, draw, index)."""
    return _uniform01(stream_key(seed, name, draw), index).mul_(high - low).add_(low)


def counter_normal(seed: int, name: str, index: torch.Tensor, *, mean: float = 0.0,
                   std: float = 1.0, draw: int = 0) -> torch.Tensor:
    """float64 normal values by inversion (:func:`_ndtri` of a counter uniform)."""
    return _ndtri(_uniform01(stream_key(seed, name, draw), index)).mul_(std).add_(mean)


# Everything below is + - * / sqrt and frexp, each a correctly rounded IEEE op, one torch op at a
# time: the result for an element does not depend on where it sits in the tensor (vectorised
# and scalar loops agree), which is what makes a shard equal its slice of the whole bit for bit.
# torch's log/exp may differ in the last bit between those loops.

_LN2 = math.log(2.0)
_LOG_COEFS = [2.0 / (2 * k + 1) for k in range(12)]      # 2 atanh(s) = log((1+s)/(1-s))


def _poly(x: torch.Tensor, coefs: Sequence[float]) -> torch.Tensor:
    """sum(coefs[k] * x**k) by Horner's rule."""
    acc = torch.full_like(x, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = acc * x + c
    return acc


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then
    log m = 2 atanh((m-1)/(m+1)) by its series (|s| <= 0.172: 12 terms reach 1e-18)."""
    m, e = torch.frexp(x)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)
    e = e.to(torch.float64) - low.to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    return s * _poly(s * s, _LOG_COEFS) + e * _LN2


# Wichura, "Algorithm AS 241: The percentage points of the normal distribution", Applied
# Statistics 37(3), 1988: PPND16, accurate to about 1e-16.
_AS241_A = [3.3871328727963666080e0, 1.3314166789178437745e2, 1.9715909503065514427e3,
            1.3731693765509461125e4, 4.5921953931549871457e4, 6.7265770927008700853e4,
            3.3430575583588128105e4, 2.5090809287301226727e3]
_AS241_B = [1.0, 4.2313330701600911252e1, 6.8718700749205790830e2, 5.3941960214247511077e3,
            2.1213794301586595867e4, 3.9307895800092710610e4, 2.8729085735721942674e4,
            5.2264952788528545610e3]
_AS241_C = [1.42343711074968357734e0, 4.63033784615654529590e0, 5.76949722146069140550e0,
            3.64784832476320460504e0, 1.27045825245236838258e0, 2.41780725177450611770e-1,
            2.27238449892691845833e-2, 7.74545014278341407640e-4]
_AS241_D = [1.0, 2.05319162663775882187e0, 1.67638483018380384940e0, 6.89767334985100004550e-1,
            1.48103976427480074590e-1, 1.51986665636164571966e-2, 5.47593808499534494600e-4,
            1.05075007164441684324e-9]
_AS241_E = [6.65790464350110377720e0, 5.46378491116411436990e0, 1.78482653991729133580e0,
            2.96560571828504891230e-1, 2.65321895265761230930e-2, 1.24266094738807843860e-3,
            2.71155556874348757815e-5, 2.01033439929228813265e-7]
_AS241_F = [1.0, 5.99832206555887937690e-1, 1.36929880922735805310e-1,
            1.48753612908506148525e-2, 7.86869131145613259100e-4, 1.84631831751005468180e-5,
            1.42151175831644588870e-7, 2.04426310338993978564e-15]


def _ndtri(p: torch.Tensor) -> torch.Tensor:
    """The standard normal quantile of float64 ``p`` in (0, 1) (AS 241)."""
    q = p - 0.5
    r = 0.180625 - q * q
    central = q * _poly(r, _AS241_A) / _poly(r, _AS241_B)
    s = torch.sqrt(-_log(torch.minimum(p, 1.0 - p)))
    near = _poly(s - 1.6, _AS241_C) / _poly(s - 1.6, _AS241_D)
    far = _poly(s - 5.0, _AS241_E) / _poly(s - 5.0, _AS241_F)
    tail = torch.where(s <= 5.0, near, far)
    tail = torch.where(q < 0, -tail, tail)
    return torch.where(q.abs() <= 0.425, central, tail)


def _phi(x: float) -> float:
    """The standard normal CDF (Python float)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))

