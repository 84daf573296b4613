// Whether the library holds the kernels for AVX-512's extensions (VNNI, BF16, AMX and
// the AVX-512 attention passes) beside the AVX2 ones every path falls back to. It does
// unless built on a CPU without AVX-512F (build.py passes KVSERVE_AVX512_BUILT=0
// there, and the library's name says so): such a CPU never takes them (each is
// called only where its *_here() says the CPU has it), and skipping them takes a
// quarter off the build a first start waits for. Left out, each *_here() is false.
#pragma once

#ifndef KVSERVE_AVX512_BUILT
#define KVSERVE_AVX512_BUILT 1
#endif
