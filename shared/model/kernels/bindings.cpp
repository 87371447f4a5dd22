// Python bindings of the AFlex CPU kernels (one extension module, built by shared/model/cpu_kernels.py).
#include "aflex_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512_vnni", &aflex::cpu_has_avx512_vnni, "whether this CPU runs the kernels");
  m.def("pack_weight", &aflex::pack_weight, "int8 [N, K] -> VNNI panels of w + 128");
  m.def("int8_linear", &aflex::int8_linear, "per-row int8 quantisation, rotation, VNNI product and rescale");
  m.def("decode_attention", &aflex::decode_attention, "one-token attention over paged float32 KV slots");
}
