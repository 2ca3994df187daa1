/* How far apart two of this machine's cores are (#14): one cache line passed
   back and forth between two threads pinned to the first two CPUs the process may use,
   the median round trip of 7 runs of 20,000 in nanoseconds, printed as
   "round_trip_ns VALUE" ("one_cpu 1" where the process has a single CPU).

   A VM's host may move its vCPUs apart for minutes at a time, which slows a multi-thread
   step: bench_int4 records the round trip beside every multi-thread run. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TRIPS 20000
#define RUNS 7

static _Alignas(64) _Atomic long flag;
static int cpus[2];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *unused) {  /* odd values come from the first thread */
    (void)unused;
    pin(cpus[1]);
    for (long i = 0; i < (long)RUNS * TRIPS; i++) {
        while (atomic_load(&flag) != 2 * i + 1) {}
        atomic_store(&flag, 2 * i + 2);
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    cpu_set_t allowed;
    sched_getaffinity(0, sizeof allowed, &allowed);
    int found = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && found < 2; cpu++)
        if (CPU_ISSET(cpu, &allowed)) cpus[found++] = cpu;
    if (found < 2) {
        printf("one_cpu 1\n");
        return 0;
    }
    pin(cpus[0]);
    pthread_t other;
    pthread_create(&other, NULL, answer, NULL);
    double trips[RUNS];
    long i = 0;
    for (int run = 0; run < RUNS; run++) {
        const double started = now();
        for (int trip = 0; trip < TRIPS; trip++, i++) {
            atomic_store(&flag, 2 * i + 1);
            while (atomic_load(&flag) != 2 * i + 2) {}
        }
        trips[run] = (now() - started) / TRIPS * 1e9;
    }
    pthread_join(other, NULL);
    qsort(trips, RUNS, sizeof trips[0], by_value);
    printf("round_trip_ns %.1f\n", trips[RUNS / 2]);
    return 0;
}
