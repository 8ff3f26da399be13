// DSV41 overlay: the guard translation unit of the native SWA decode module.
//
// The module serves FlashInfer 0.7.2's DSV4 sparse-MLA decode straight out of SGLang's 256-token
// SWA pool pages (no 256 -> 64 page split). It adds no kernel: the kernel instances come from the
// stock decode_dispatch.cu and the plan from the stock attention_resolve.cu of the INSTALLED
// flashinfer-python, compiled beside this file by runtime/build_native_decode.py.
//
// decode_dsv4_body.inc is generated at build time into the build folder (never committed): it is
// the host body of FlashInfer's stock SparseMlaSm120DecodeDsv4 (attention_binding.cu), renamed
// StockDecodeDsv4Body, so the served call validates and launches exactly like the stock export.
// This file only adds the guard: DSV4 (d_qk 512), footer layout, pages of exactly
// DSV41_NATIVE_PAGE_SIZE tokens, no FP4 extra cache. Anything else fails a TVM_FFI_ICHECK, which
// reaches Python as a RuntimeError that the switch logs once and answers with the stock copy path.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h>
#include <flashinfer/attention/sparse_mla_sm120/model/model_type.h>
#include <tvm/ffi/container/array.h>

#include <flashinfer/attention/sparse_mla_sm120/model/dsv41_layout.cuh>

#include "sparse_mla_sm120/attention_descriptor.h"
#include "sparse_mla_sm120/attention_dispatch.h"
#include "sparse_mla_sm120/attention_validation.h"

#ifndef DSV41_NATIVE_PAGE_SIZE
#define DSV41_NATIVE_PAGE_SIZE 256
#endif

using tvm::ffi::Optional;

namespace flashinfer::sparse_mla_sm120 {

using bf16 = __nv_bfloat16;

#include "decode_dsv4_body.inc"

namespace dsv41 {

void NativePageDecode(TensorView q, TensorView kv_cache, TensorView indices, TensorView mid_out,
                      TensorView mid_lse, TensorView output, TensorView out_lse,
                      int64_t num_splits, double sm_scale, Optional<TensorView> topk_length,
                      Optional<TensorView> attn_sink, Optional<TensorView> extra_kv_cache,
                      Optional<TensorView> extra_indices, Optional<TensorView> extra_topk_length,
                      int64_t chunks_per_block_override, double lse_scale) {
  constexpr auto kModel = ModelType::DSV4;
  TVM_FFI_ICHECK_EQ(q.ndim(), 3) << "dsv41 native decode: q must be [T, H, 512], got ndim="
                                 << q.ndim();
  TVM_FFI_ICHECK_EQ(q.size(2), KVCacheTraits<kModel>::D_QK)
      << "dsv41 native decode serves DSV4 (d_qk=512) only, got d_qk=" << q.size(2);
  const PagedKVLayout layout = parse_paged_kv_layout(
      kv_cache, KVCacheTraits<kModel>::BYTES_PER_TOKEN, /*inline_scale=*/false, "kv_cache");
  TVM_FFI_ICHECK_EQ(layout.page_block_size, DSV41_NATIVE_PAGE_SIZE)
      << "dsv41 native decode is built for page_block_size=" << DSV41_NATIVE_PAGE_SIZE
      << ", got " << layout.page_block_size;
  StockDecodeDsv4Body(q, kv_cache, indices, mid_out, mid_lse, output, out_lse, num_splits,
                      sm_scale, topk_length, attn_sink, extra_kv_cache, extra_indices,
                      extra_topk_length, int64_t(kModel), chunks_per_block_override,
                      /*extra_fp4=*/false, lse_scale);
}

int64_t NativePageSize() { return DSV41_NATIVE_PAGE_SIZE; }

}  // namespace dsv41
}  // namespace flashinfer::sparse_mla_sm120

TVM_FFI_DLL_EXPORT_TYPED_FUNC(dsv4_native_page_decode,
                              flashinfer::sparse_mla_sm120::dsv41::NativePageDecode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(native_page_size,
                              flashinfer::sparse_mla_sm120::dsv41::NativePageSize);
