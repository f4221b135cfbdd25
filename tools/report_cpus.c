/* LD_PRELOAD shim: sched_getaffinity reports CPUS (default 4) schedulable CPUs, so
 * XLA:CPU sizes its executor pool for them on a smaller host. The GPU interpreter runs
 * each warpgroup of a Mosaic GPU kernel as an XLA:CPU program whose barrier waits hold
 * an executor thread; flex_mgpu_ws has 3 warpgroups, and on 2 cores it can deadlock
 * (docs/gpu_kernel.md). Only for running those interpreted tests on a small host:
 *
 *   gcc -shared -fPIC -o /tmp/report_cpus.so tools/report_cpus.c
 *   LD_PRELOAD=/tmp/report_cpus.so python -m pytest -m thorough tests/kernels/test_flex_mgpu.py -k ws_interpreted
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <string.h>

int sched_getaffinity(pid_t pid, size_t size, cpu_set_t *mask) {
  (void)pid;
  const char *cpus = getenv("CPUS");
  int n = cpus ? atoi(cpus) : 4;
  memset(mask, 0, size);
  for (int i = 0; i < n; i++) CPU_SET_S(i, size, mask);
  return 0;
}
