/*
 * netem-delayer: the compiled NFQUEUE delayer of the netem harness (backend "nfqueue-c").
 *
 * The kernel here has no netem, fq or etf qdisc, so one-way delay is done in userspace: the
 * hub's FORWARD rule queues every packet routed to site i on NFQUEUE i, and this program
 * holds each packet until arrival + delay (+- jitter), then accepts it. It replaces the
 * per-packet Python callback of netem/_agent.py (about 15 us of CPU per packet) with a few
 * hundred nanoseconds: one recv() per packet and one batched verdict per site per wake-up.
 *
 * Started by the agent (python -m netem._agent) inside the hub namespace:
 *
 *     netem-delayer --queues N --max-queue-len L --rcvbuf-bytes B --parent-pid P [--state-dir D]
 *
 * (--state-dir is only a marker in the command line, so tests can find leftovers.)
 *
 * Control protocol, one ASCII line per request on stdin, answers on stdout:
 *     delay <site> <delay_ns> <jitter_ns> [<reorder_ppm> <reorder_gap_ns>]
 *                                           set a site's delay (and reordering); answer "ok"
 *     stats                                 one line per site:
 *                                           "site <i> <delayed> <held> <max_held> <late> <max_late_ns>
 *                                            <overflow> <reordered>"
 *                                           then "wakeups <n>", then "end"
 * On start-up, after every queue is bound, it prints "ready". EOF on stdin (the agent closed
 * the pipe or died) accepts every held packet, unbinds and exits 0.
 *
 * Semantics, as in the Python delayer:
 *   - due = max(arrival + delay + U(-jitter, +jitter), due of the previous packet to that
 *     site), so packets to one site are never reordered (per-site FIFO, due times monotone);
 *   - reordering (netem's "reorder", turned around): with probability reorder_ppm / 1e6 a packet
 *     is held reorder_gap longer (due + gap) in a second FIFO of its own, so the packets that
 *     arrive within the gap after it overtake it; the others keep their FIFO. While such a packet
 *     is held, releases are per packet (a batched verdict "up to id X" would release it too);
 *   - at most max-queue-len packets held per site: the kernel's queue has the same bound and
 *     drops beyond it, so the ring below never overflows (if it did, the packet is dropped
 *     and counted as held-overflow, never delayed wrongly);
 *   - "late": released more than 1 ms after its due time (counted, and the worst kept);
 *   - all times from CLOCK_MONOTONIC; the wait is ppoll() with a nanosecond timeout.
 *
 * Batching: the kernel numbers the packets of one queue in arrival order, and this program
 * releases each site's packets in arrival order, so "accept every packet of queue i up to id
 * X" (nfq_set_verdict_batch) releases exactly the due prefix in one message.
 *
 * Lifetime: prctl(PR_SET_PDEATHSIG, SIGKILL) and a check that the parent is still the agent
 * given by --parent-pid, so a SIGKILLed agent never leaves this process behind; the kernel
 * drops the packets it still held when its netlink socket closes.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <libnetfilter_queue/libnetfilter_queue.h>

#define MAX_SITES 200
#define LATE_NS 1000000LL     /* a release later than this counts as late */
#define MAX_RECV_PER_WAKE 512 /* packets read before releasing again (bounds the loop) */
#define CTRL_BUF 4096

struct held {
    int64_t due_ns;
    uint32_t id;
};

struct site {
    int index;
    struct nfq_q_handle *qh;
    int64_t delay_ns, jitter_ns, last_due_ns;
    struct held *ring; /* circular FIFO of capacity cap */
    uint32_t cap, head, len;
    uint32_t reorder_ppm; /* packets held back by reorder_gap_ns, per million */
    int64_t reorder_gap_ns, last_late_due_ns;
    struct held *late; /* circular FIFO (capacity cap) of the packets held back */
    uint32_t late_head, late_len;
    uint64_t num_delayed, num_late, num_overflow, max_held, num_reordered;
    int64_t max_late_ns;
};

static struct site sites[MAX_SITES];
static int num_sites;
static uint64_t rng_state;
static int64_t tick_ns; /* at most one wake-up per tick while busy (see the main loop) */
static uint64_t num_wakeups; /* ppoll returns: each one a context switch, the main cost per packet */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* xorshift64*: jitter needs speed, not cryptographic quality. */
static uint64_t rng_next(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ULL;
}

/* Uniform in [-j, +j] nanoseconds. */
static int64_t jitter_sample(int64_t j) {
    if (j <= 0)
        return 0;
    return (int64_t)(rng_next() % (uint64_t)(2 * j + 1)) - j;
}

/* NFQUEUE callback: one packet arrived for site s; queue it with its due time. */
static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)msg;
    struct site *s = data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (ph == NULL)
        return 0;
    uint32_t id = ntohl(ph->packet_id);
    if (s->len + s->late_len >= s->cap) { /* cannot happen while the kernel bound holds; never delay wrongly */
        s->num_overflow++;
        return nfq_set_verdict(qh, id, NF_DROP, 0, NULL);
    }
    int64_t delay = s->delay_ns + jitter_sample(s->jitter_ns);
    if (delay < 0)
        delay = 0;
    int64_t due = now_ns() + delay;
    if (s->reorder_ppm > 0 && rng_next() % 1000000ULL < s->reorder_ppm) { /* held back: overtaken */
        due += s->reorder_gap_ns;
        if (due < s->last_late_due_ns)
            due = s->last_late_due_ns;
        s->last_late_due_ns = due;
        s->late[(s->late_head + s->late_len) % s->cap] = (struct held){.due_ns = due, .id = id};
        s->late_len++;
        s->num_delayed++;
        s->num_reordered++;
        return 0;
    }
    if (due < s->last_due_ns)
        due = s->last_due_ns; /* keep arrival order */
    s->last_due_ns = due;
    s->ring[(s->head + s->len) % s->cap] = (struct held){.due_ns = due, .id = id};
    s->len++;
    s->num_delayed++;
    if (s->len > s->max_held)
        s->max_held = s->len;
    return 0;
}

static void note_late(struct site *s, int64_t late) {
    if (late > LATE_NS) {
        s->num_late++;
        if (late > s->max_late_ns)
            s->max_late_ns = late;
    }
}

/* Accept every packet of s that is due at `now`: the held-back ones one by one, then the FIFO's due
 * prefix with one batched verdict, or one by one while a held-back packet (a lower id) waits. */
static void release_due(struct site *s, int64_t now) {
    while (s->late_len > 0 && s->late[s->late_head].due_ns <= now) {
        struct held *h = &s->late[s->late_head];
        note_late(s, now - h->due_ns);
        if (nfq_set_verdict(s->qh, h->id, NF_ACCEPT, 0, NULL) < 0)
            fprintf(stderr, "netem-delayer: verdict for queue %d failed: %s\n", s->index, strerror(errno));
        s->late_head = (s->late_head + 1) % s->cap;
        s->late_len--;
    }
    int one_by_one = s->late_len > 0;
    uint32_t last_id = 0;
    int any = 0;
    while (s->len > 0) {
        struct held *h = &s->ring[s->head];
        if (h->due_ns > now)
            break;
        note_late(s, now - h->due_ns);
        if (one_by_one && nfq_set_verdict(s->qh, h->id, NF_ACCEPT, 0, NULL) < 0)
            fprintf(stderr, "netem-delayer: verdict for queue %d failed: %s\n", s->index, strerror(errno));
        last_id = h->id;
        any = !one_by_one;
        s->head = (s->head + 1) % s->cap;
        s->len--;
    }
    if (any && nfq_set_verdict_batch(s->qh, last_id, NF_ACCEPT) < 0)
        fprintf(stderr, "netem-delayer: verdict for queue %d failed: %s\n", s->index, strerror(errno));
}

/* Release everything still held (orderly exit). */
static void release_all(void) {
    for (int i = 0; i < num_sites; i++)
        release_due(&sites[i], INT64_MAX);
}

/* Earliest due time over all sites, or -1 when nothing is held. */
static int64_t next_due(void) {
    int64_t best = -1;
    for (int i = 0; i < num_sites; i++) {
        struct site *s = &sites[i];
        if (s->len > 0 && (best < 0 || s->ring[s->head].due_ns < best))
            best = s->ring[s->head].due_ns;
        if (s->late_len > 0 && (best < 0 || s->late[s->late_head].due_ns < best))
            best = s->late[s->late_head].due_ns;
    }
    return best;
}

/* One control request (a line without its newline); answers on stdout. */
static void handle_line(char *line) {
    int site;
    long long d, j, ppm = 0, gap = 0;
    int n = sscanf(line, "delay %d %lld %lld %lld %lld", &site, &d, &j, &ppm, &gap);
    if (n == 3 || n == 5) {
        if (site < 0 || site >= num_sites || d < 0 || j < 0 || ppm < 0 || ppm > 1000000 || gap < 0) {
            printf("error bad delay request: %s\n", line);
        } else {
            sites[site].delay_ns = d;
            sites[site].jitter_ns = j;
            sites[site].reorder_ppm = (uint32_t)ppm;
            sites[site].reorder_gap_ns = gap;
            printf("ok\n");
        }
    } else if (strcmp(line, "stats") == 0) {
        for (int i = 0; i < num_sites; i++) {
            struct site *s = &sites[i];
            printf("site %d %llu %u %llu %llu %lld %llu %llu\n", i, (unsigned long long)s->num_delayed,
                   s->len + s->late_len, (unsigned long long)s->max_held, (unsigned long long)s->num_late,
                   (long long)s->max_late_ns, (unsigned long long)s->num_overflow,
                   (unsigned long long)s->num_reordered);
        }
        printf("wakeups %llu\n", (unsigned long long)num_wakeups);
        printf("end\n");
    } else {
        printf("error unknown request: %s\n", line);
    }
    fflush(stdout);
}

/* Read what stdin has; run each complete line. Returns 0 on EOF (time to exit), 1 otherwise. */
static int read_control(char *buf, size_t *used) {
    ssize_t n = read(STDIN_FILENO, buf + *used, CTRL_BUF - 1 - *used);
    if (n == 0)
        return 0;
    if (n < 0)
        return (errno == EINTR || errno == EAGAIN) ? 1 : 0;
    *used += (size_t)n;
    buf[*used] = '\0';
    char *start = buf, *nl;
    while ((nl = strchr(start, '\n')) != NULL) {
        *nl = '\0';
        handle_line(start);
        start = nl + 1;
    }
    *used = strlen(start);
    memmove(buf, start, *used + 1);
    if (*used >= CTRL_BUF - 1) /* a line longer than the buffer: drop it */
        *used = 0;
    return 1;
}

/* Read up to MAX_RECV_PER_WAKE packets from the netlink socket without blocking. */
static void read_packets(struct nfq_handle *h, int fd) {
    char buf[4096] __attribute__((aligned));
    for (int i = 0; i < MAX_RECV_PER_WAKE; i++) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == ENOBUFS) /* the socket overflowed: the kernel dropped packets */
                continue;
            if (errno != EAGAIN && errno != EINTR)
                fprintf(stderr, "netem-delayer: recv: %s\n", strerror(errno));
            return;
        }
        nfq_handle_packet(h, buf, (int)n);
    }
}

static long parse_arg(int argc, char **argv, const char *name, long dflt) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return strtol(argv[i + 1], NULL, 10);
    return dflt;
}

/* Open the NFQUEUE handle and bind queue i for each site i. Exits with a message on failure. */
static struct nfq_handle *bind_queues(long max_len, long rcvbuf) {
    struct nfq_handle *h = nfq_open();
    if (h == NULL) {
        perror("netem-delayer: nfq_open");
        exit(2);
    }
    nfq_bind_pf(h, AF_INET); /* needed by old kernels only; harmless (and may fail) on new ones */
    for (int i = 0; i < num_sites; i++) {
        struct site *s = &sites[i];
        s->index = i;
        s->cap = (uint32_t)max_len;
        s->ring = calloc(s->cap, sizeof *s->ring);
        s->late = calloc(s->cap, sizeof *s->late);
        s->qh = nfq_create_queue(h, (uint16_t)i, on_packet, s);
        if (s->ring == NULL || s->late == NULL || s->qh == NULL) {
            fprintf(stderr, "netem-delayer: cannot bind queue %d: %s\n", i, strerror(errno));
            exit(2);
        }
        if (nfq_set_mode(s->qh, NFQNL_COPY_META, 0) < 0 || nfq_set_queue_maxlen(s->qh, (uint32_t)max_len) < 0) {
            fprintf(stderr, "netem-delayer: cannot configure queue %d: %s\n", i, strerror(errno));
            exit(2);
        }
    }
    int fd = nfq_fd(h);
    int size = (int)rcvbuf;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, sizeof size) < 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    int one = 1; /* report overflows as drops, not as a socket error that stops reading */
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);
    return h;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        printf("netem-delayer 2\n");
        return 0;
    }
    num_sites = (int)parse_arg(argc, argv, "--queues", 0);
    long max_len = parse_arg(argc, argv, "--max-queue-len", 20000);
    long rcvbuf = parse_arg(argc, argv, "--rcvbuf-bytes", 8 << 20);
    long parent = parse_arg(argc, argv, "--parent-pid", 0);
    tick_ns = parse_arg(argc, argv, "--tick-ns", 100000);
    if (num_sites < 1 || num_sites > MAX_SITES || max_len < 1 || max_len > 1000000 || rcvbuf < 4096) {
        fprintf(stderr, "usage: netem-delayer --queues 1..%d --max-queue-len 1..1000000 [--rcvbuf-bytes B]"
                        " [--parent-pid P]\n", MAX_SITES);
        return 2;
    }
    /* Die with the agent: SIGKILL on the parent's exit, and the parent may already be gone. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (parent > 0 && getppid() != (pid_t)parent)
        return 3;
    signal(SIGPIPE, SIG_IGN);
    /* Real-time priority where allowed (root): kernel netem delays in softirq context, ahead of
     * every user process, but this program competes for the CPU with the processes whose traffic
     * it delays. At normal priority a wake-up on a loaded 2-core host could come several ms late,
     * and every packet due meanwhile left late with it (CI once saw 7 ms on a 40 ms RTT). It sleeps
     * between ticks, and the kernel's RT throttling bounds it if it ever spun. */
    struct sched_param rt = {.sched_priority = 10};
    if (sched_setscheduler(0, SCHED_FIFO, &rt) != 0)
        fprintf(stderr, "netem-delayer: no real-time priority (%s); releases may run late under load\n",
                strerror(errno));
    rng_state = (uint64_t)now_ns() ^ ((uint64_t)getpid() << 32) ^ 0x9E3779B97F4A7C15ULL;

    struct nfq_handle *h = bind_queues(max_len, rcvbuf);
    int fd = nfq_fd(h);
    printf("ready\n");
    fflush(stdout);

    char ctrl[CTRL_BUF];
    size_t used = 0;
    struct pollfd pfd[2] = {{.fd = fd, .events = POLLIN}, {.fd = STDIN_FILENO, .events = POLLIN}};
    int64_t last_wake = 0;
    for (;;) {
        /* Wake-ups, not packets, are the cost: each is a context switch (measured ~10 us in this VM
         * under load, against ~1 us for the recv and verdict of a packet). So after one, sleep out the
         * rest of the tick before looking again: while packets flow, one wake-up per tick handles
         * every packet that arrived or fell due meanwhile. Price: a packet is stamped up to one tick
         * after it arrived and released up to one tick after it is due (delay + [0, 2 ticks]). */
        int64_t until = last_wake + tick_ns;
        if (tick_ns > 0 && now_ns() < until) {
            struct timespec t = {.tv_sec = until / 1000000000LL, .tv_nsec = until % 1000000000LL};
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL);
        }
        int64_t due = next_due();
        struct timespec ts, *tsp = NULL;
        if (due >= 0) {
            int64_t wait = due - now_ns();
            if (wait < 0)
                wait = 0;
            ts.tv_sec = wait / 1000000000LL;
            ts.tv_nsec = wait % 1000000000LL;
            tsp = &ts;
        }
        if (ppoll(pfd, 2, tsp, NULL) < 0 && errno != EINTR) {
            perror("netem-delayer: ppoll");
            break;
        }
        num_wakeups++;
        last_wake = now_ns();
        if (pfd[0].revents & (POLLIN | POLLERR))
            read_packets(h, fd);
        if (pfd[1].revents & (POLLIN | POLLHUP | POLLERR) && !read_control(ctrl, &used))
            break;
        int64_t now = now_ns();
        for (int i = 0; i < num_sites; i++)
            release_due(&sites[i], now);
    }
    release_all();
    for (int i = 0; i < num_sites; i++)
        nfq_destroy_queue(sites[i].qh);
    nfq_close(h);
    return 0;
}
