/* Replay a captured graph: call every kernel of one forward pass from C, one after the other.
 *
 * tinygrad 0.14 replays a TinyJit on the CPU from Python: for each kernel it resolves the buffers, builds
 * the argument list and calls the compiled function through ctypes, Python work for every kernel. A decode
 * step of SmolLM2-135M is ~490 kernels, so that alone is a sizeable share of the step. This loop does the
 * same calls from a table that Python fills once (tinyvllm/kernels/cpu_graph.py) and patches per step
 * (the addresses of the step's input buffers, the values of its symbolic variables): one ctypes call
 * per step, well under a microsecond per kernel. (CUDA graphs and Metal's indirect command buffers are
 * the GPU versions of the same idea; tinygrad uses them on those devices.)
 *
 *   table: the calls back to back, each  [function address, number of arguments n, argument 0 .. n-1]
 *   num_calls: how many calls the table holds
 *
 * Every argument travels as a 64-bit integer, the way tinygrad's own CPU runtime passes them: buffer
 * addresses, and ints (symbolic variables) that the callee reads from the low half of the register or
 * stack slot (the x86-64 and arm64 calling conventions agree on that).
 */
typedef unsigned long long u64;

#define TV_GRAPH_MAX_ARGS 24

/* T<n>: n parameter types;  A<n>: the first n arguments of the call */
#define T1 u64
#define T2 T1, u64
#define T3 T2, u64
#define T4 T3, u64
#define T5 T4, u64
#define T6 T5, u64
#define T7 T6, u64
#define T8 T7, u64
#define T9 T8, u64
#define T10 T9, u64
#define T11 T10, u64
#define T12 T11, u64
#define T13 T12, u64
#define T14 T13, u64
#define T15 T14, u64
#define T16 T15, u64
#define T17 T16, u64
#define T18 T17, u64
#define T19 T18, u64
#define T20 T19, u64
#define T21 T20, u64
#define T22 T21, u64
#define T23 T22, u64
#define T24 T23, u64
#define A1 a[0]
#define A2 A1, a[1]
#define A3 A2, a[2]
#define A4 A3, a[3]
#define A5 A4, a[4]
#define A6 A5, a[5]
#define A7 A6, a[6]
#define A8 A7, a[7]
#define A9 A8, a[8]
#define A10 A9, a[9]
#define A11 A10, a[10]
#define A12 A11, a[11]
#define A13 A12, a[12]
#define A14 A13, a[13]
#define A15 A14, a[14]
#define A16 A15, a[15]
#define A17 A16, a[16]
#define A18 A17, a[17]
#define A19 A18, a[18]
#define A20 A19, a[19]
#define A21 A20, a[20]
#define A22 A21, a[21]
#define A23 A22, a[22]
#define A24 A23, a[23]
#define CALL(n) case n: ((void (*)(T##n))fn)(A##n); break;

TV_KERNEL graph_runner(const u64* table, u64 num_calls) {
  const u64* e = table;
  for (u64 i = 0; i < num_calls; i++) {
    u64 fn = e[0], n = e[1];
    const u64* a = e + 2;
    switch (n) {
      case 0: ((void (*)(void))fn)(); break;
      CALL(1) CALL(2) CALL(3) CALL(4) CALL(5) CALL(6) CALL(7) CALL(8) CALL(9) CALL(10) CALL(11) CALL(12)
      CALL(13) CALL(14) CALL(15) CALL(16) CALL(17) CALL(18) CALL(19) CALL(20) CALL(21) CALL(22) CALL(23) CALL(24)
      default: return; /* cpu_graph.py never builds such an entry (it keeps tinygrad's replay instead) */
    }
    e += 2 + n;
  }
}
