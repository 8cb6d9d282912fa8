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
 * read_seq % capacity once its seq equals read_seq + 1, then stores read_seq + 1. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nw.h"

static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static nw_ring_header_t* ring_ptr = NULL;
static uint32_t event_counter = 0;

uint32_t nw_next_event_id(void) { return __atomic_add_fetch(&event_counter, 1, __ATOMIC_RELAXED); }

static void ring_open(void) {
  const char* tmpl = getenv("NETWEAVE_PROF_RING");
  if (tmpl == NULL || tmpl[0] == '\0') return;
  char path[512];
  size_t j = 0;
  for (size_t i = 0; tmpl[i] != '\0' && j + 16 < sizeof(path); i++) {
    if (tmpl[i] == '%' && tmpl[i + 1] == 'p') {
      j += (size_t)snprintf(path + j, sizeof(path) - j, "%d", (int)getpid());
      i++;
    } else {
      path[j++] = tmpl[i];
    }
  }
  path[j] = '\0';
  unsigned long cap = 65536;
  const char* c = getenv("NETWEAVE_PROF_CAPACITY");
  if (c != NULL && c[0] != '\0') cap = strtoul(c, NULL, 0);
  if (cap < 16 || cap > (1ul << 24) || (cap & (cap - 1)) != 0) {
    NW_WARN("NETWEAVE_PROF_CAPACITY=%s must be a power of two in [16, 2^24]; profiler ring disabled", c);
    return;
  }
  size_t bytes = NW_RING_HEADER + cap * sizeof(nw_record_t);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    NW_WARN("cannot create profiler ring %s: %m", path);
    return;
  }
  if (ftruncate(fd, (off_t)bytes) != 0) {
    NW_WARN("cannot size profiler ring %s: %m", path);
    close(fd);
    return;
  }
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    NW_WARN("cannot map profiler ring %s: %m", path);
    return;
  }
  nw_ring_header_t* h = p;
  h->version = NW_RING_VERSION;
  h->header_size = NW_RING_HEADER;
  h->record_size = sizeof(nw_record_t);
  h->capacity = (uint32_t)cap;
  h->pid = (int32_t)getpid();
  __atomic_store_n(&h->magic, NW_RING_MAGIC, __ATOMIC_RELEASE); /* readers check the magic last */
  ring_ptr = h;
  NW_INFO(NCCL_INIT | NCCL_PROFILE, "profiler ring %s: %lu records", path, cap);
}

nw_ring_header_t* nw_ring_get(void) {
  pthread_once(&ring_once, ring_open);
  return ring_ptr;
}

int nw_ring_put(nw_ring_header_t* h, nw_record_t* rec) {
  uint64_t cap = h->capacity;
  uint64_t idx = __atomic_load_n(&h->write_seq, __ATOMIC_RELAXED);
  for (;;) {
    uint64_t rd = __atomic_load_n(&h->read_seq, __ATOMIC_ACQUIRE);
    if (idx - rd >= cap) {
      __atomic_add_fetch(&h->dropped, 1, __ATOMIC_RELAXED);
      return -1;
    }
    if (__atomic_compare_exchange_n(&h->write_seq, &idx, idx + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) break;
  }
  nw_record_t* slot = (nw_record_t*)((char*)h + NW_RING_HEADER) + (idx & (cap - 1));
  rec->t_ns = rec->t_ns ? rec->t_ns : nw_now_ns();
  /* copy everything but the commit marker, then publish */
  memcpy((char*)slot + sizeof(uint64_t), (char*)rec + sizeof(uint64_t), sizeof(*rec) - sizeof(uint64_t));
  __atomic_store_n(&slot->seq, idx + 1, __ATOMIC_RELEASE);
  return 0;
}

/* Exported for harnesses and tests: write one user event (kind NW_EV_USER) into the ring. */
NW_EXPORT int netweave_ring_emit(uint64_t comm_id, uint64_t coll_seq, uint64_t bytes, int32_t peer, int32_t step) {
  nw_ring_header_t* h = nw_ring_get();
  if (h == NULL) return -1;
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
  return nw_ring_put(h, &r);
}
