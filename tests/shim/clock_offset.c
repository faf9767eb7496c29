/* A wall clock that runs `TOLLGATE_CLOCK_OFFSET_MS` milliseconds ahead of (or, negative,
 * behind) the host's, for the process it is preloaded into (LD_PRELOAD): `gettimeofday`,
 * `time` and `clock_gettime` of the realtime clocks are shifted; monotonic clocks are not.
 * The tests run a redis-server whose `TIME` is off by a known amount with it. libfaketime
 * does the same in general but deadlocks in Debian's jemalloc-linked redis-server (jemalloc
 * reads the clock while libfaketime initialises); this shim reads the clock with the raw
 * system call and allocates nothing, so it has nothing to initialise. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ms(void) {
    static volatile int read_once;
    static long long offset;
    if (!read_once) {
        const char *v = getenv("TOLLGATE_CLOCK_OFFSET_MS");
        offset = v ? atoll(v) : 0;
        read_once = 1;
    }
    return offset;
}

static int shifts(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, id, ts);
    if (r == 0 && ts && shifts(id)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ms() * 1000000LL;
        ts->tv_sec = (time_t)(ns / 1000000000LL);
        ts->tv_nsec = (long)(ns % 1000000000LL);
    }
    return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return -1;
    }
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return (time_t)-1;
    }
    if (t) {
        *t = ts.tv_sec;
    }
    return ts.tv_sec;
}
