"""The suite's two kinds of numerical claim, stated once.

**Exact** (``torch.equal``, ``atol=0``, ``== 0.0``): only where it holds by construction, on every processor: the
same operations run on the same tensors, in the same layout, so every kernel sees the same input and returns the same
bits (the bridge running Hugging Face's own module on the same input; the engine's own baseline against a patch whose
source is the target itself; one IEEE operation such as a subtraction done in either library; a tensor written and
read back). Each such assertion says why next to it.

**Reordered** (:func:`assert_close_reordered`): two code paths that compute the same value with the operations in
another order or on tensors of another memory layout: a fused projection against a split one, the fast engine against
the model's forward, another kernel. Their last bits depend on the processor: torch's vectorised CPU kernels work in
blocks of two SIMD registers (16 floats on AVX2, 32 on AVX-512, 8 on NEON) and finish a row's remainder with the
scalar formula, so whether an element takes the vector or the scalar path depends on the row length, the layout and
the processor. The tolerance is ``REORDER_ULPS`` units in the last place of the dtype, scaled by the largest
magnitude compared: a few roundings compounded through a handful of layers, far below any effect a test looks for.
"""

from __future__ import annotations

import torch

#: How many units in the last place (of the largest magnitude compared) a reordered computation may differ by.
REORDER_ULPS = 64


def reordered_tolerance(reference: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> float:
    """The absolute tolerance for values of ``reference``'s magnitude computed in ``dtype`` by a reordered path."""
    magnitude = (
        float(reference.detach().abs().max()) if isinstance(reference, torch.Tensor) else abs(reference)
    )
    return REORDER_ULPS * torch.finfo(dtype).eps * max(magnitude, 1.0)


def assert_close_reordered(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """``actual`` equals ``expected`` up to the rounding of a reordered computation (see the module docstring)."""
    dtype = expected.dtype if expected.is_floating_point() else torch.float32
    torch.testing.assert_close(
        actual, expected, atol=reordered_tolerance(expected, dtype), rtol=0, equal_nan=True, msg=msg
    )
