/* netweave test harness for the flow-plan grammar: loads the plugin library with dlopen (as NCCL
 * does), parses plans with its exported netweave_plan_check and prints each one canonically --
 * the text flowsched.ncclhook.format_plan(parse_plan(text)) must reproduce byte for byte.
 *   plan_check LIB FILE...   one result per file
 *   plan_check LIB -         batch: stdin holds records <u32 little-endian length><bytes>; stdout
 *                            gets one record per input in the same framing
 * A result is "OK\n" + the canonical plan, or "ERROR <code> line <n>: <message>\n".
 *
 * Built with clang -fsanitize=fuzzer,address -DNW_LIBFUZZER (linking ../plan.c instead of dlopen)
 * it is a libFuzzer target whose property is: canonical(text) parses, and canonical(canonical(text))
 * == canonical(text). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../nw.h"

typedef int (*check_fn)(const char*, size_t, nw_plan_t*, char*, size_t, int*);
typedef const char* (*name_fn)(int, int);
static check_fn plan_check;
static name_fn plan_name;

typedef struct { char* buf; size_t len, cap; } out_t;

__attribute__((format(printf, 2, 3))) static void put(out_t* o, const char* fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    if (n < 0) abort();
    if ((size_t)n < o->cap - o->len) { o->len += (size_t)n; return; }
    o->cap = 2 * o->cap + (size_t)n + 1;
    o->buf = realloc(o->buf, o->cap);
    if (o->buf == NULL) abort();
  }
}

static void put_mark(out_t* o, const nw_mark_t* m) {
  if (m->cls != NW_UNSET) put(o, " class=%d", m->cls);
  if (m->dscp != NW_UNSET) put(o, " dscp=%d", m->dscp);
  if (m->prio != NW_UNSET) put(o, " prio=%d", m->prio);
  if (m->rate != NW_UNSET) put(o, " rate=%" PRId64, m->rate);
  if (m->nsocks != NW_UNSET) put(o, " nsocks=%d", m->nsocks);
  if (m->sockchunk != NW_UNSET) put(o, " sockchunk=%" PRId64, m->sockchunk);
}

/* the same order and spelling as flowsched.ncclhook.format_plan */
static void canonical(out_t* o, const nw_plan_t* p) {
  put(o, "netweave-plan %d\n", p->version);
  for (int k = 0; k < NW_NUM_CLASSES; k++)
    if (p->cls_line[k]) { put(o, "class %d", k); put_mark(o, &p->cls_own[k]); put(o, "\n"); }
  for (int i = 0; i < p->ncomm; i++) {
    const nw_comm_rule_t* r = &p->comm[i];
    if (r->sel == NW_SEL_COMM) put(o, "comm 0x%" PRIx64, r->id);
    else put(o, "order %" PRIu64, r->id);
    put_mark(o, &r->m);
    put(o, "\n");
  }
  for (int i = 0; i < p->ntune; i++) {
    const nw_tune_rule_t* r = &p->tune[i];
    if (r->sel == NW_SEL_ANY) put(o, "tune *");
    else if (r->sel == NW_SEL_CLASS) put(o, "tune class:%" PRIu64, r->id);
    else if (r->sel == NW_SEL_COMM) put(o, "tune comm:0x%" PRIx64, r->id);
    else put(o, "tune order:%" PRIu64, r->id);
    if (r->coll != NW_UNSET) put(o, " coll=%s", plan_name(0, r->coll));
    if (r->has_min) put(o, " min=%" PRIu64, r->min_bytes);
    if (r->has_max) put(o, " max=%" PRIu64, r->max_bytes);
    if (r->algo != NW_UNSET) put(o, " algo=%s", plan_name(1, r->algo));
    if (r->proto != NW_UNSET) put(o, " proto=%s", plan_name(2, r->proto));
    if (r->channels != NW_UNSET) put(o, " channels=%d", r->channels);
    if (r->chunk != NW_UNSET) put(o, " chunk=%" PRId64, r->chunk);
    put(o, "\n");
  }
  for (int i = 0; i < p->nport; i++) {
    const nw_port_rule_t* r = &p->port[i];
    if (r->port == NW_UNSET) put(o, "mark *");
    else put(o, "mark %d", r->port);
    if (r->dscp != NW_UNSET) put(o, " dscp=%d", r->dscp);
    if (r->prio != NW_UNSET) put(o, " prio=%d", r->prio);
    put(o, "\n");
  }
}

/* result of one plan into o; returns the parser's code */
static int check_one(out_t* o, const char* text, size_t len) {
  nw_plan_t* plan = malloc(sizeof(*plan));
  if (plan == NULL) abort();
  char err[256];
  int line = -1;
  int rc = plan_check(text, len, plan, err, sizeof(err), &line);
  if (rc == NW_PLAN_OK) {
    put(o, "OK\n");
    canonical(o, plan);
  } else {
    put(o, "ERROR %d line %d: %s\n", rc, line, err);
  }
  free(plan);
  return rc;
}

#ifdef NW_LIBFUZZER
NW_EXPORT int netweave_plan_check(const char*, size_t, nw_plan_t*, char*, size_t, int*);
NW_EXPORT const char* netweave_plan_name(int, int);

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  plan_check = netweave_plan_check;
  plan_name = netweave_plan_name;
  out_t a = {malloc(256), 0, 256}, b = {malloc(256), 0, 256};
  if (check_one(&a, (const char*)data, size) == NW_PLAN_OK) {
    const char* text = a.buf + 3; /* after "OK\n" */
    if (check_one(&b, text, a.len - 3) != NW_PLAN_OK || b.len != a.len || memcmp(a.buf, b.buf, a.len) != 0) abort();
  }
  free(a.buf);
  free(b.buf);
  return 0;
}
#else
static char* read_all(FILE* f, size_t* len) {
  size_t cap = 4096, n = 0;
  char* buf = malloc(cap);
  for (size_t got; buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
    n += got;
    if (n == cap) buf = realloc(buf, cap *= 2);
  }
  *len = n;
  return buf;
}

int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s LIB FILE... | %s LIB -\n", argv[0], argv[0]); return 2; }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "FAIL dlopen: %s\n", dlerror()); return 1; }
  const nw_plan_info_t* info = dlsym(h, "netweave_plan_info");
  plan_check = (check_fn)dlsym(h, "netweave_plan_check");
  plan_name = (name_fn)dlsym(h, "netweave_plan_name");
  if (!info || !plan_check || !plan_name) { fprintf(stderr, "FAIL the library exports no plan checker\n"); return 1; }
  if (info->abi != NW_PLAN_ABI || info->plan_size != sizeof(nw_plan_t)) { fprintf(stderr, "FAIL plan ABI %u, harness %d\n", info->abi, NW_PLAN_ABI); return 1; }
  out_t o = {malloc(4096), 0, 4096};
  if (strcmp(argv[2], "-") != 0) {
    for (int i = 2; i < argc; i++) {
      FILE* f = fopen(argv[i], "rb");
      if (!f) { fprintf(stderr, "FAIL cannot open %s\n", argv[i]); return 1; }
      size_t len;
      char* text = read_all(f, &len);
      fclose(f);
      o.len = 0;
      check_one(&o, text, len);
      fwrite(o.buf, 1, o.len, stdout);
      free(text);
    }
    free(o.buf);
    return 0;
  }
  for (;;) {
    uint32_t len;
    if (fread(&len, sizeof(len), 1, stdin) != 1) break;
    char* text = malloc(len ? len : 1);
    if (text == NULL || fread(text, 1, len, stdin) != len) { fprintf(stderr, "FAIL short record\n"); return 1; }
    o.len = 0;
    check_one(&o, text, len);
    uint32_t n = (uint32_t)o.len;
    fwrite(&n, sizeof(n), 1, stdout);
    fwrite(o.buf, 1, o.len, stdout);
    free(text);
  }
  free(o.buf);
  fflush(stdout);
  return 0;
}
#endif
