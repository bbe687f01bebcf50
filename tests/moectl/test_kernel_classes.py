"""The kernel-category table of `bench train`, on the kernel names H100 profiles show (and CPU op names)."""

from __future__ import annotations

import pytest

from moectl.bench.kernel_classes import CATEGORIES, classify

COPY = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}> >(int, ...)")  # fmt: skip
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>"
GROUPED = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::"
           "GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, ...> > >")  # fmt: skip

CASES = [
    ("_wgrad_kernel", (), "moe.experts", "grouped_gemm"),  # trainer/kernels/grouped_wgrad_triton.py
    ("_wgrad_kernel_tma", (), "moe.experts", "grouped_gemm"),  # its TMA variant (Hopper)
    ("_fp8_wgrad_kernel_tma", (), "moe.experts", "grouped_gemm"),  # trainer/kernels/fp8_wgrad_triton.py
    # (kernel name, ops innermost first, region, category)
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", ("aten::mm", "aten::matmul", "aten::linear"), "attention",
     "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas", ("aten::mm",), "model.head", "dense_gemm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", ("aten::mm",), "moe.router", "dense_gemm"),  # the router's GEMM
    # fp8 GEMMs carry e4m3 in their names: still GEMMs, not quantize
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_cublas", ("aten::_scaled_mm",), "attention",
     "dense_gemm"),
    (GROUPED, ("aten::_grouped_mm",), "moe.experts", "grouped_gemm"),
    (GROUPED, ("aten::_scaled_grouped_mm",), None, "grouped_gemm"),
    ("nvjet_tst_128x128_64x5_2x1_v_bz_NNT", ("aten::mm",), "moe.experts", "grouped_gemm"),  # loop backend
    ("triton_tem_fused_mm_0", ("## Call CompiledFxGraph ##",), "attention", "dense_gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t,"
     " Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true>(Flash_fwd_params)",
     ("aten::_flash_attention_forward", "aten::_scaled_dot_product_flash_attention"), "attention", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", ("aten::_scaled_dot_product_cudnn_"
     "attention",), "attention", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", (), None, "attention"),
    # a copy inside SDPA belongs to attention (the op around it decides)
    (COPY, ("aten::copy_", "aten::contiguous", "aten::scaled_dot_product_attention"), "attention", "attention"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", (), "optimizer.step", "comm"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ("c10d::alltoall_base_",), "moe.dispatch", "comm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>", ("aten::_fused_adamw_",), None, "optimizer"),
    (ADD, ("aten::add_",), "optimizer.step", "optimizer"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", ("aten::mm",), "optimizer.step", "optimizer"),  # Muon
    ("_quantize_kernel", (), "optimizer.step", "quantize"),  # fp8 param gather's post-step quantize
    ("_quantize_kernel", (), "moe.experts", "quantize"),
    ("_amax_kernel", (), "attention", "quantize"),
    ("_mx_quantize_kernel", (), None, "quantize"),
    ("_transpose_kernel", (), None, "quantize"),
    # inductor names its kernels after the ops it fused: a fused norm is no copy, a fused softmax no quantizer
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", ("## Call CompiledFxGraph ##",), "norm", "elementwise"),
    ("triton_per_fused__softmax_amax_exp_sub_sum_0", (), "moe.router", "router"),
    ("triton_poi_fused__to_copy_cat_mul_sub_1", (), "attention", "elementwise"),
    (ADD, ("aten::add_", "torch::autograd::AccumulateGrad"), None, "grad_accum"),
    (ADD, ("aten::add_",), "grad.accumulate", "grad_accum"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
     ("aten::index_select",), "moe.dispatch", "dispatch"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>", ("aten::index",), "moe.experts", "dispatch"),
    ("void cub::DeviceRadixSortOnesweepKernel<...>", ("aten::sort",), "moe.experts", "dispatch"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>", ("aten::index",), "attention", "elementwise"),
    ("kernelHistogram1D<long, long, long, 1, 2, -1, (CUDAHistogramMemoryType)1, ...>", ("aten::bincount",),
     "moe.router", "router"),
    (COPY, ("aten::copy_", "aten::_to_copy"), "moe.combine", "dispatch"),
    ("cunn_SoftMaxForward<4, float, float, float, cunn::LogSoftMaxForwardEpilogue>", (), "model.loss", "loss"),
    (COPY, ("aten::copy_", "aten::_to_copy", "aten::to"), "norm", "copy_cast"),
    ("Memcpy DtoD (Device -> Device)", ("aten::copy_",), None, "copy_cast"),
    ("Memset (Device)", ("aten::zero_",), "moe.experts", "copy_cast"),
    ("void at::native::CatArrayBatchedCopy<...>", ("aten::cat",), "attention", "copy_cast"),
    (ADD, ("aten::add",), "attention", "elementwise"),
    ("_glu_fwd_kernel", (), "moe.experts", "elementwise"),
    # CPU runs: the outermost aten ops, name == innermost op
    ("aten::linear", ("aten::linear",), "attention", "dense_gemm"),
    ("aten::_grouped_mm", ("aten::_grouped_mm",), "moe.experts", "grouped_gemm"),
    ("aten::scaled_dot_product_attention", ("aten::scaled_dot_product_attention",), "attention", "attention"),
    ("aten::_to_copy", ("aten::_to_copy",), "norm", "copy_cast"),
    ("aten::mul", ("aten::mul",), "norm", "elementwise"),
]  # fmt: skip


@pytest.mark.parametrize("name,ops,region,expected", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_classify(name, ops, region, expected):
    assert classify(name, ops, region) == expected


def test_every_category_is_reachable():
    assert {c[3] for c in CASES} == set(CATEGORIES)
