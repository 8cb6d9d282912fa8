/* netweave: the current flow plan of this process ($NETWEAVE_PLAN), re-read when the file
 * changes (checked at most every 100 ms). A plan that fails the grammar, or a file that is not a
 * regular file of at most NW_PLAN_MAX_BYTES, is refused with a warning and the previous plan (or
 * the defaults) stays in force. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nw.h"

static pthread_mutex_t plan_lock = PTHREAD_MUTEX_INITIALIZER;
static nw_plan_t plan_current;
static int plan_ready = 0;
static struct timespec plan_mtime;
static off_t plan_size = -1;
static uint64_t plan_checked_ns = 0;
static uint64_t plan_generation = 0;

/* Read a whole regular file of at most NW_PLAN_MAX_BYTES; NULL with a reason otherwise. */
static char* read_plan_file(int fd, const struct stat* st, size_t* len, const char** why) {
  if (!S_ISREG(st->st_mode)) { *why = "not a regular file"; return NULL; }
  if (st->st_size > NW_PLAN_MAX_BYTES) { *why = "larger than the 1 MiB a plan may have"; return NULL; }
  char* text = malloc((size_t)st->st_size + 1);
  if (text == NULL) { *why = "out of memory"; return NULL; }
  size_t got = 0;
  while (got < (size_t)st->st_size) {
    ssize_t n = read(fd, text + got, (size_t)st->st_size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break; /* shrank while we read: parse what is there, the next check sees the new size */
    got += (size_t)n;
  }
  text[got] = '\0';
  *len = got;
  return text;
}

static void plan_reload_locked(void) {
  const char* path = getenv("NETWEAVE_PLAN");
  if (!plan_ready) {
    nw_plan_defaults(&plan_current);
    plan_current.generation = ++plan_generation;
    plan_ready = 1;
  }
  if (path == NULL || path[0] == '\0') return;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* O_NONBLOCK: a FIFO must not hang NCCL */
  if (fd < 0) return; /* keep the last good plan (or the defaults) */
  struct stat st;
  if (fstat(fd, &st) != 0 ||
      (plan_size == st.st_size && plan_mtime.tv_sec == st.st_mtim.tv_sec && plan_mtime.tv_nsec == st.st_mtim.tv_nsec)) {
    close(fd);
    return;
  }
  plan_size = st.st_size;
  plan_mtime = st.st_mtim;
  size_t len = 0;
  const char* why = NULL;
  char* text = read_plan_file(fd, &st, &len, &why);
  close(fd);
  if (text == NULL) {
    NW_WARN("plan %s: %s; keeping the previous plan", path, why);
    return;
  }
  nw_plan_t* fresh = malloc(sizeof(*fresh));
  char err[256];
  int line = 0;
  if (fresh != NULL && nw_plan_parse(text, len, fresh, err, sizeof(err), &line) == NW_PLAN_OK) {
    fresh->generation = ++plan_generation;
    plan_current = *fresh;
    NW_INFO(NCCL_INIT | NCCL_NET, "loaded plan %s (generation %" PRIu64 ")", path, plan_generation);
  } else if (fresh != NULL) {
    NW_WARN("plan %s: line %d: %s; keeping the previous plan", path, line, err);
  }
  free(fresh);
  free(text);
}

uint64_t nw_plan_snapshot(nw_plan_t* out) {
  pthread_mutex_lock(&plan_lock);
  uint64_t now = nw_now_ns();
  if (!plan_ready || now - plan_checked_ns > 100000000ull) {
    plan_checked_ns = now;
    plan_reload_locked();
  }
  if (out) *out = plan_current;
  uint64_t gen = plan_current.generation;
  pthread_mutex_unlock(&plan_lock);
  return gen;
}
