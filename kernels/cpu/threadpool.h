/* A persistent thread pool for the CPU kernels: how one kernel launch uses both cores.
 *
 * Why it exists: tinygrad 0.14 runs every CPU program on ONE thread. A program that declares a
 * `core_id` is not spread over cores: the runtime calls it once per core_id value, one after the
 * other (tinygrad/runtime/ops_cpu.py, CPUProgram.__call__ and cpu_exec). A matrix-vector product
 * is bound by memory bandwidth, and two cores read memory faster than one; a batched matmul is
 * bound by FMAs, and two cores have twice as many.
 *
 * So the pool's helper threads are started ONCE, from Python (tinyvllm/kernels/cpu_threads.py),
 * each running `tv_pool_worker_loop` below, the same pattern as tinygrad's own CPU queue worker
 * (a C loop on a Python thread). A kernel launch then goes:
 *
 *     calling thread (runs the program)          helper thread(s)
 *     ---------------------------------          ----------------
 *     take the pool (owner 0 -> 1)               spinning, or parked on a semaphore
 *     publish job: fn, ctx
 *     ticket = (seq+1, num_chunks, 0) ------->   sees a new seq
 *     wake parked helpers (sem_post)
 *     grab chunks: CAS ticket -> ticket+1        grab chunks the same way
 *     run fn(ctx, chunk) ...                     run fn(ctx, chunk) ...
 *     wait until finished == num_chunks  <----   finished += 1 per chunk
 *     release the pool (owner 1 -> 0)            spin a while, then park again
 *
 * Chunks are handed out one at a time, so a helper that is slow to wake costs nothing: the calling
 * thread simply runs more chunks. What it cannot do is take back a chunk a helper has started, so
 * when other processes keep the cores busy and the OS pauses a helper mid-chunk, the launch waits
 * for it: on such a machine one thread can be faster (measured: up to 3x on small matmuls at a
 * load average of 5 on 2 cores; TINYVLLM_CPU_THREADS=1). Which thread runs a chunk does not change
 * the arithmetic, so results are bit-identical with 1 or N threads.
 *
 * The pool's control block lives at TV_POOL_ADDR (a compile-time constant; 0 = no pool, run
 * single-threaded). It is mapped by Python, at the same address in every process when possible,
 * so that kernel sources, and the compiled binaries tinygrad caches by source, stay identical.
 * The layout of `struct tv_pool` is mirrored in cpu_threads.py: change both together.
 *
 * Everything here is `static inline` and always inlined: a kernel's entry function must be the
 * first function in its object file, because tinygrad's CPU loader jumps to the start of the image.
 */
#ifndef TV_THREADPOOL_H
#define TV_THREADPOOL_H

#define TV_MAX_WORKERS 15
#define TV_MAX_CHUNKS 0xffff  /* chunks per launch that the ticket can count; more run on the calling thread */
#define TV_INLINE static inline __attribute__((always_inline))
/* how long a helper spins for the next job before parking: 4096 pause instructions. It stays awake across the
 * few small kernels between two matmuls, and parks when the engine is idle. */
#define TV_SPIN_ITERS 4096

/* TV_THREADS: the threads of the pool (the launching one and its helpers), a define from the launcher; 1 without one.
 * A matrix-vector product (M = 1) reads w from memory once, and every chunk a thread takes starts a new stream.
 * So it is cut into 4 chunks per thread (a late helper leaves at most a few chunks to wait for), each at least
 * 96 KB (small matrices keep chunks fine enough to share). Measured on 2 cores at 1B shapes, weights from memory:
 * 1 or 4 chunks per thread read 10-15% more bytes per second than the 96 KB chunks of before, 8 per thread less. */
#ifndef TV_THREADS
#define TV_THREADS 1
#endif
#define TV_STREAM_CHUNK_BYTES(rows, row_bytes) \
  ((long long)(rows) * (row_bytes) / (4 * TV_THREADS) > 98304 ? (long long)(rows) * (row_bytes) / (4 * TV_THREADS) : 98304)

typedef void (*tv_chunk_fn)(const void* ctx, int chunk);

struct tv_pool {
  /* written by Python once */
  unsigned int enabled;       /* 0: kernels run single-threaded (no helpers, or after fork()) */
  unsigned int num_workers;   /* helper threads running tv_pool_worker_loop */
  unsigned int stop;          /* 1: helpers return */
  unsigned int pad0;
  int (*sem_wait)(void* sem); /* libc's, as function pointers: kernels are linked without libc */
  int (*sem_post)(void* sem);
  int (*sched_yield)(void);
  /* the current job, written by the thread that owns the pool */
  unsigned long long ticket;  /* job sequence number << 32 | number of chunks << 16 | next chunk to hand out */
  unsigned int finished;      /* chunks of the current job that are done */
  unsigned int owner;         /* 0: free, 1: a kernel launch is using the pool */
  tv_chunk_fn fn;
  const void* ctx;
  /* parking: one flag and one semaphore (a libc sem_t, 32 bytes) per helper */
  unsigned int sleeping[TV_MAX_WORKERS + 1];
  unsigned long long sems[TV_MAX_WORKERS][4];
};

TV_INLINE void tv_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

/* Grab chunks of job `seq` until none are left. Returns when the job is fully handed out.
 *
 * The chunk count lives in the ticket itself, next to the job number and the next chunk: one 64-bit word read
 * and swapped atomically. (With the count in a field of its own, a helper still looking at a finished job could
 * read the NEXT job's count while its launcher is still filling in the job, and take a chunk that does not exist.)
 * A successful CAS on (seq, count, c) with c < count proves job seq is still running, so fn and ctx, read after
 * the ticket, are that job's: its launcher cannot publish another before every chunk is taken and finished. */
TV_INLINE void tv_pool_run_chunks(struct tv_pool* pool, unsigned long long seq) {
  for (;;) {
    unsigned long long t = __atomic_load_n(&pool->ticket, __ATOMIC_ACQUIRE);
    if ((t >> 32) != seq) return;                        /* a later job: this one is done */
    unsigned int count = (unsigned int)(t >> 16) & TV_MAX_CHUNKS, chunk = (unsigned int)t & TV_MAX_CHUNKS;
    if (chunk >= count) return;                          /* all handed out */
    tv_chunk_fn fn = __atomic_load_n(&pool->fn, __ATOMIC_RELAXED);
    const void* ctx = __atomic_load_n(&pool->ctx, __ATOMIC_RELAXED);
    if (!__atomic_compare_exchange_n(&pool->ticket, &t, t + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    fn(ctx, (int)chunk);
    __atomic_fetch_add(&pool->finished, 1, __ATOMIC_RELEASE);
  }
}

/* Run fn(ctx, c) for c in [0, num_chunks), spread over the calling thread and the pool's helpers. */
TV_INLINE void tv_parallel_for(tv_chunk_fn fn, const void* ctx, int num_chunks) {
#if TV_POOL_ADDR
  struct tv_pool* pool = (struct tv_pool*)TV_POOL_ADDR;
  if (num_chunks > 1 && num_chunks <= TV_MAX_CHUNKS && __atomic_load_n(&pool->enabled, __ATOMIC_RELAXED) &&
      __atomic_exchange_n(&pool->owner, 1, __ATOMIC_ACQUIRE) == 0) {
    __atomic_store_n(&pool->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&pool->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&pool->finished, 0, __ATOMIC_RELAXED);
    unsigned long long seq = ((__atomic_load_n(&pool->ticket, __ATOMIC_RELAXED) >> 32) + 1) & 0xffffffffull;
    /* publish (release): whoever reads this ticket also sees fn, ctx and finished above */
    __atomic_store_n(&pool->ticket, seq << 32 | (unsigned long long)num_chunks << 16, __ATOMIC_SEQ_CST);
    for (unsigned int i = 0; i < pool->num_workers; i++)
      if (__atomic_exchange_n(&pool->sleeping[i], 0, __ATOMIC_SEQ_CST)) pool->sem_post(&pool->sems[i]);
    tv_pool_run_chunks(pool, seq);
    /* every chunk is handed out; wait for the ones a helper is still running. That is one chunk's time, unless
     * the OS took the helper's core away (a busy machine): then give ours up too, the helper may be queued on it */
    for (int spins = 0; __atomic_load_n(&pool->finished, __ATOMIC_ACQUIRE) != (unsigned int)num_chunks; spins++) {
      if (spins < TV_SPIN_ITERS) tv_pause();
      else pool->sched_yield();
    }
    __atomic_store_n(&pool->owner, 0, __ATOMIC_RELEASE);
    return;
  }
#endif
  /* no pool, or another launch holds it (two threads running kernels at once): run everything here */
  for (int c = 0; c < num_chunks; c++) fn(ctx, c);
}

/* The body of a helper thread: wait for a job, help run it, repeat until `stop`. */
TV_INLINE void tv_pool_worker_loop(struct tv_pool* pool, unsigned int index) {
  unsigned long long seen = __atomic_load_n(&pool->ticket, __ATOMIC_ACQUIRE) >> 32;
  for (;;) {
    int spins = 0;
    unsigned long long seq;
    while ((seq = __atomic_load_n(&pool->ticket, __ATOMIC_ACQUIRE) >> 32) == seen) {
      if (__atomic_load_n(&pool->stop, __ATOMIC_RELAXED)) return;
      if (++spins < TV_SPIN_ITERS) { tv_pause(); continue; }
      /* park. Announce it first, then look once more: either we see the new job, or the launcher
       * sees `sleeping` (both are seq_cst, so they cannot both miss each other) and posts. */
      __atomic_store_n(&pool->sleeping[index], 1, __ATOMIC_SEQ_CST);
      int still_idle = (__atomic_load_n(&pool->ticket, __ATOMIC_SEQ_CST) >> 32) == seen;
      if (still_idle && !__atomic_load_n(&pool->stop, __ATOMIC_SEQ_CST)) {
        pool->sem_wait(&pool->sems[index]);
      } else if (!__atomic_exchange_n(&pool->sleeping[index], 0, __ATOMIC_SEQ_CST)) {
        pool->sem_wait(&pool->sems[index]);   /* the launcher took the flag: consume its post */
      }
      spins = 0;
    }
    seen = seq;
    tv_pool_run_chunks(pool, seq);
  }
}

#endif
