/* netweave: shared-memory event ring (multi-producer, one reader).
 *
 * File layout (little-endian, $NETWEAVE_PROF_RING, "%p" -> pid):
 *   [0,128)   nw_ring_header_t: magic, version, header_size, record_size, capacity,
 *             write_seq (claimed by writers), read_seq (advanced by the reader),
 *             dropped (records refused because the ring was full), pid, flags
 *   [128, 128 + 64*capacity)  records; record i lives in slot i % capacity
 * A writer claims index i only while i - read_seq < capacity (never overwrites unread
 * records; a full ring counts the record in `dropped` instead), fills the slot, then
 * publishes it by storing seq = i + 1 with release order. The reader consumes slot
 * read_seq % capacity once its seq equals read_seq + 1, then stores read_seq + 1.
 *
 * Safety rules (the file is shared with whoever can write it):
 *   - the file is opened with O_NOFOLLOW and created with O_EXCL (mode 0644 less the umask); a
 *     symbolic link, another user's file, a file with several links, a file that is not a
 *     netweave ring, or a ring a live process holds (flock) is refused: the profiler is disabled
 *     with a warning and the file is left as it was. A stale ring of this user is reused.
 *   - the writer keeps its own capacity and mapped size; slot indices never come from the
 *     shared header. Every append checks the header's magic, version, sizes and capacity
 *     against what this process mapped; a changed header disables the ring (NW_RING_BAD). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nw.h"

#define RING_MIN_CAPACITY 16ul
#define RING_MAX_CAPACITY (1ul << 24)

static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static nw_ring_t ring_state;
static nw_ring_t* ring_ptr = NULL;
static uint32_t event_counter = 0;

uint32_t nw_next_event_id(void) { return __atomic_add_fetch(&event_counter, 1, __ATOMIC_RELAXED); }

/* "%p" -> pid; -1 when the result does not fit */
static int expand_path(const char* tmpl, char* path, size_t n) {
  size_t j = 0;
  for (size_t i = 0; tmpl[i] != '\0'; i++) {
    if (tmpl[i] == '%' && tmpl[i + 1] == 'p') {
      int w = snprintf(path + j, n - j, "%d", (int)getpid());
      if (w < 0 || (size_t)w >= n - j) return -1;
      j += (size_t)w;
      i++;
    } else {
      if (j + 1 >= n) return -1;
      path[j++] = tmpl[i];
    }
  }
  path[j] = '\0';
  return 0;
}

/* NETWEAVE_PROF_CAPACITY: a power of two in [16, 2^24] written in decimal; default 65536 */
static int ring_capacity(unsigned long* cap) {
  const char* c = getenv("NETWEAVE_PROF_CAPACITY");
  *cap = 65536;
  if (c == NULL || c[0] == '\0') return 0;
  char* end = NULL;
  errno = 0;
  unsigned long v = (c[0] >= '0' && c[0] <= '9') ? strtoul(c, &end, 10) : 0;
  if (errno != 0 || end == NULL || *end != '\0' || v < RING_MIN_CAPACITY || v > RING_MAX_CAPACITY || (v & (v - 1)) != 0) {
    NW_WARN("NETWEAVE_PROF_CAPACITY=%s must be a power of two in [16, 2^24]; profiler ring disabled", c);
    return -1;
  }
  *cap = v;
  return 0;
}

/* Open the ring file by the rules above: a new file, or a stale ring of ours. Returns an fd that
 * holds the file's exclusive flock (kept open for the life of the process), or -1 with why. */
static int open_ring_file(const char* path, char* why, size_t whylen) {
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd >= 0) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return fd;
    snprintf(why, whylen, "cannot lock the new file: %s", strerror(errno));
    close(fd);
    return -1;
  }
  if (errno != EEXIST) {
    snprintf(why, whylen, "cannot create it: %s", strerror(errno));
    return -1;
  }
  fd = open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP)
      snprintf(why, whylen, "it is a symbolic link");
    else
      snprintf(why, whylen, "it exists and cannot be opened: %s", strerror(errno));
    return -1;
  }
  struct stat st;
  nw_ring_header_t old;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    snprintf(why, whylen, "it exists and is not a regular file");
  else if (st.st_uid != geteuid())
    snprintf(why, whylen, "it exists and belongs to uid %d", (int)st.st_uid);
  else if (st.st_nlink != 1)
    snprintf(why, whylen, "it exists with %d links", (int)st.st_nlink);
  else if (st.st_size < NW_RING_HEADER || pread(fd, &old, sizeof(old), 0) != (ssize_t)sizeof(old) || old.magic != NW_RING_MAGIC ||
           old.version != NW_RING_VERSION || old.header_size != NW_RING_HEADER || old.record_size != sizeof(nw_record_t))
    snprintf(why, whylen, "it exists and is not a netweave profiler ring");
  else if (flock(fd, LOCK_EX | LOCK_NB) != 0)
    snprintf(why, whylen, "process %d still writes it", (int)old.pid);
  else if (ftruncate(fd, 0) != 0) /* zeroes the stale ring: a reader waits for the new magic */
    snprintf(why, whylen, "cannot reset the stale ring: %s", strerror(errno));
  else
    return fd;
  close(fd);
  return -1;
}

static void ring_open(void) {
  const char* tmpl = getenv("NETWEAVE_PROF_RING");
  if (tmpl == NULL || tmpl[0] == '\0') return;
  char path[512], why[160];
  if (expand_path(tmpl, path, sizeof(path)) != 0) {
    NW_WARN("NETWEAVE_PROF_RING is longer than %zu bytes; profiler ring disabled", sizeof(path) - 1);
    return;
  }
  unsigned long cap;
  if (ring_capacity(&cap) != 0) return;
  size_t bytes = NW_RING_HEADER + cap * sizeof(nw_record_t);
  int fd = open_ring_file(path, why, sizeof(why));
  if (fd < 0) {
    NW_WARN("profiler ring %s refused: %s; profiler ring disabled", path, why);
    return;
  }
  if (ftruncate(fd, (off_t)bytes) != 0) {
    NW_WARN("cannot size profiler ring %s: %s", path, strerror(errno));
    close(fd);
    return;
  }
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    NW_WARN("cannot map profiler ring %s: %s", path, strerror(errno));
    close(fd);
    return;
  }
  /* fd stays open: its flock tells a later process that this ring is live */
  nw_ring_header_t* h = p;
  h->version = NW_RING_VERSION;
  h->header_size = NW_RING_HEADER;
  h->record_size = sizeof(nw_record_t);
  h->capacity = (uint32_t)cap;
  h->pid = (int32_t)getpid();
  __atomic_store_n(&h->magic, NW_RING_MAGIC, __ATOMIC_RELEASE); /* readers check the magic last */
  ring_state.h = h;
  ring_state.capacity = cap;
  ring_state.bytes = bytes;
  ring_ptr = &ring_state;
  NW_INFO(NCCL_INIT | NCCL_PROFILE, "profiler ring %s: %lu records", path, cap);
}

nw_ring_t* nw_ring_get(void) {
  pthread_once(&ring_once, ring_open);
  return ring_ptr;
}

/* the shared header still describes the mapping this process made */
static int header_intact(const nw_ring_t* r) {
  const nw_ring_header_t* h = r->h;
  return __atomic_load_n(&h->magic, __ATOMIC_RELAXED) == NW_RING_MAGIC && __atomic_load_n(&h->version, __ATOMIC_RELAXED) == NW_RING_VERSION &&
         __atomic_load_n(&h->header_size, __ATOMIC_RELAXED) == NW_RING_HEADER &&
         __atomic_load_n(&h->record_size, __ATOMIC_RELAXED) == sizeof(nw_record_t) &&
         __atomic_load_n(&h->capacity, __ATOMIC_RELAXED) == r->capacity;
}

int nw_ring_put(nw_ring_t* r, nw_record_t* rec) {
  if (__atomic_load_n(&r->bad, __ATOMIC_RELAXED)) return NW_RING_BAD;
  nw_ring_header_t* h = r->h;
  if (!header_intact(r)) {
    if (__atomic_exchange_n(&r->bad, 1, __ATOMIC_RELAXED) == 0)
      NW_WARN("profiler ring header changed under this process (capacity %u, magic %#llx; mapped %llu records): ring disabled",
              (unsigned)__atomic_load_n(&h->capacity, __ATOMIC_RELAXED), (unsigned long long)__atomic_load_n(&h->magic, __ATOMIC_RELAXED),
              (unsigned long long)r->capacity);
    return NW_RING_BAD;
  }
  uint64_t cap = r->capacity; /* ours, never the header's */
  uint64_t idx = __atomic_load_n(&h->write_seq, __ATOMIC_RELAXED);
  for (;;) {
    uint64_t rd = __atomic_load_n(&h->read_seq, __ATOMIC_ACQUIRE);
    if (idx - rd >= cap) {
      __atomic_add_fetch(&h->dropped, 1, __ATOMIC_RELAXED);
      return NW_RING_FULL;
    }
    if (__atomic_compare_exchange_n(&h->write_seq, &idx, idx + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) break;
  }
  nw_record_t* slot = (nw_record_t*)((char*)h + NW_RING_HEADER) + (idx & (cap - 1));
  rec->t_ns = rec->t_ns ? rec->t_ns : nw_now_ns();
  /* copy everything but the commit marker, then publish */
  memcpy((char*)slot + sizeof(uint64_t), (char*)rec + sizeof(uint64_t), sizeof(*rec) - sizeof(uint64_t));
  __atomic_store_n(&slot->seq, idx + 1, __ATOMIC_RELEASE);
  return NW_RING_OK;
}

/* Exported for harnesses and tests: write one user event (kind NW_EV_USER) into the ring.
 * Returns NW_RING_OK, NW_RING_FULL, NW_RING_BAD, or NW_RING_NONE without a ring. */
NW_EXPORT int netweave_ring_emit(uint64_t comm_id, uint64_t coll_seq, uint64_t bytes, int32_t peer, int32_t step) {
  nw_ring_t* ring = nw_ring_get();
  if (ring == NULL) return NW_RING_NONE;
  nw_record_t r;
  memset(&r, 0, sizeof(r));
  r.kind = NW_EV_USER;
  r.comm_id = comm_id;
  r.coll_seq = coll_seq;
  r.bytes = bytes;
  r.peer = peer;
  r.step = step;
  r.event_id = nw_next_event_id();
  r.traffic_class = -1;
  return nw_ring_put(ring, &r);
}
