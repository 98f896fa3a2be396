"""The exact O(T)-memory implementations of HKT attention, one module per ``impl``:

* :mod:`.sdpa` (``"sdpa"``): one ``scaled_dot_product_attention`` call on the concatenated levels;
* :mod:`.blockwise`: the one autograd Function and interface of the blockwise kernels;
* :mod:`.fused_torch` (``"fused_torch"``): the PyTorch tile loop, the kernels' specification;
* :mod:`.fused_cpp` (``"fused_cpp"``): the C++/OpenMP kernel (``csrc/``);
* :mod:`.fused_triton` (``"fused_triton"``): the Triton kernels (:mod:`._triton_hkt`);
* :mod:`.extension`: the one loader of every compiled C++ piece (attention, decoding step,
  convolution).

Every implementation takes ``(q, k, v, lam(H, L), stride, causal, key_padding_mask, scale,
dropout_p)`` after :func:`structattn.hkt.hkt_attention` has validated them.
"""

from .fused_cpp import cpp_hkt_attention
from .fused_torch import fused_hkt_attention
from .fused_triton import triton_available, triton_hkt_attention
from .sdpa import masked_sdpa, sdpa_attention

__all__ = [
    "cpp_hkt_attention",
    "fused_hkt_attention",
    "masked_sdpa",
    "sdpa_attention",
    "triton_available",
    "triton_hkt_attention",
]
