/* The entry point of one helper thread of the CPU thread pool (see threadpool.h).
 *
 * Python compiles this once and runs it on a daemon thread; the call returns only when the pool is
 * stopped, so the thread lives as long as the process.
 *
 *   pool:  (1,) struct tv_pool, the control block mapped by tinyvllm/kernels/cpu_threads.py
 *   index: which helper this is, 0 .. pool->num_workers-1 (its semaphore and `sleeping` flag)
 */
#include "threadpool.h"

TV_KERNEL threadpool_worker(struct tv_pool* pool, unsigned long long index) {
  tv_pool_worker_loop(pool, (unsigned int)index);
}
