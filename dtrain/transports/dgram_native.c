/* The datagram data path's per-datagram work in batches: seal, open, send, receive.
 *
 * Loaded with ctypes by dtrain/transports/datagram_native.py, which builds it once per
 * source hash with gcc against OpenSSL's libcrypto. Python hands over whole batches (up
 * to a few hundred datagrams) in flat buffers: one datagram per slot of `stride` bytes.
 * ctypes releases the GIL for the call, so sealing, authentication and the system calls
 * run beside the Python threads.
 *
 * The wire format is datagram_wire.py's: a 43-byte header that is the AEAD's associated
 * data, then the body sealed with AES-256-GCM (NIST SP 800-38D) and its 16-byte tag. The
 * 96-bit nonce is sender (u16, header bytes 29-30) | 0 (u16) | sequence (u64, bytes
 * 31-38): byte for byte what the Python Sealer and Opener (the cryptography package,
 * which wraps the same OpenSSL cipher) produce and accept.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <netinet/in.h>
#include <time.h>

#include <openssl/evp.h>

#define HDR 43
#define TAG 16
#define MAX_BATCH 1024
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103 /* linux/udp.h, Linux >= 4.18 */
#endif
#define GSO_MAX_SEGS 64        /* UDP_MAX_SEGMENTS of Linux 4.18-5.x (128 since) */
#define GSO_MAX_BYTES 65000    /* a super-datagram's payload stays under IPv4/UDP's 65,507 */
#ifndef UDP_GRO
#define UDP_GRO 104 /* linux/udp.h, Linux >= 5.0 */
#endif
#define GRO_SLOTS 64           /* coalesced reads per recvmmsg of dg_recv_gro */
#define GRO_SLOT_BYTES 65536   /* a coalesced read's payload: at most UDP's 65,535 */
/* slots lie this far apart: not a power of two, so the starts of 64 one-datagram reads do not
 * all fall into the same cache sets (64 KiB apart, they did: +0.3 µs a datagram) */
#define GRO_SLOT_STRIDE (GRO_SLOT_BYTES + 17 * 64)

int dg_version(void) { return 8; }

/* A key. The cipher contexts are made per call: a round's key is used by several sending
 * threads at once, and an EVP_CIPHER_CTX is not safe to share between threads. */
typedef struct {
    unsigned char key[32];
} dg_aead;

void *dg_aead_new(const unsigned char *key) {
    dg_aead *a = calloc(1, sizeof(*a));
    if (!a) return NULL;
    memcpy(a->key, key, 32);
    return a;
}

void dg_aead_free(void *p) {
    dg_aead *a = p;
    if (!a) return;
    OPENSSL_cleanse(a->key, sizeof(a->key));
    free(a);
}

static EVP_CIPHER_CTX *ctx_for(const dg_aead *a, int enc) {
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    if (c && EVP_CipherInit_ex(c, EVP_aes_256_gcm(), NULL, a->key, NULL, enc) != 1) {
        EVP_CIPHER_CTX_free(c);
        return NULL;
    }
    return c;
}

static void nonce_of(const unsigned char *hdr, unsigned char nonce[12]) {
    nonce[0] = hdr[29];
    nonce[1] = hdr[30];
    nonce[2] = 0;
    nonce[3] = 0;
    memcpy(nonce + 4, hdr + 31, 8);
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int k = 0; k < bytes; k++) p[k] = (unsigned char)(v >> (8 * k));
}

/* Seal n datagrams of one kind from one sender in one round. cols: n rows of 7 int64 fields
 * (bucket, chunk, offset, numel, codec, frag, nfrags), written with magic (2 bytes), version,
 * kind, run, round, sender and sequence number seq0 + i into row i's 43-byte header
 * (datagram_wire.HEADER, little-endian); body: the plaintexts back to back, datagram i's at
 * [off[i], off[i+1]). Slot i of out (stride bytes) receives header | ciphertext | tag and
 * lens[i] its length. Returns n; -1 when a slot is too small or the cipher fails, -2 when a
 * field does not fit its wire width (nothing is usable then). */
int dg_seal(void *p, int n, const unsigned char *magic, uint32_t version, uint32_t kind, uint32_t run,
            uint32_t round, uint32_t sender, uint64_t seq0, const int64_t *cols, const unsigned char *body,
            const uint64_t *off, unsigned char *out, uint32_t stride, uint32_t *lens) {
    static const int64_t wmax[7] = {0xFFFFFFFFLL, 0xFFFFFFFFLL, 0xFFFFFFFFLL, 0xFFFFFFFFLL, 0xFF, 0xFFFF, 0xFFFF};
    unsigned char nonce[12];
    EVP_CIPHER_CTX *c;
    int rc = n;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 7; j++)
            if (cols[i * 7 + j] < 0 || cols[i * 7 + j] > wmax[j]) return -2;
    if (!(c = ctx_for(p, 1))) return -1;
    for (int i = 0; i < n && rc == n; i++) {
        const int64_t *f = cols + (size_t)i * 7;
        uint64_t blen = off[i + 1] - off[i];
        unsigned char *h = out + (size_t)i * stride;
        int outl = 0, finl = 0;
        if (HDR + blen + TAG > stride) {
            rc = -1;
            break;
        }
        h[0] = magic[0];
        h[1] = magic[1];
        h[2] = (unsigned char)version;
        h[3] = (unsigned char)kind;
        put_le(h + 4, run, 4);
        put_le(h + 8, round, 4);
        put_le(h + 12, (uint64_t)f[0], 4);
        put_le(h + 16, (uint64_t)f[1], 4);
        put_le(h + 20, (uint64_t)f[2], 4);
        put_le(h + 24, (uint64_t)f[3], 4);
        h[28] = (unsigned char)f[4];
        put_le(h + 29, sender, 2);
        put_le(h + 31, seq0 + (uint64_t)i, 8);
        put_le(h + 39, (uint64_t)f[5], 2);
        put_le(h + 41, (uint64_t)f[6], 2);
        nonce_of(h, nonce);
        if (EVP_EncryptInit_ex(c, NULL, NULL, NULL, nonce) != 1 || EVP_EncryptUpdate(c, NULL, &outl, h, HDR) != 1 ||
            EVP_EncryptUpdate(c, h + HDR, &outl, body + off[i], (int)blen) != 1 ||
            EVP_EncryptFinal_ex(c, h + HDR + outl, &finl) != 1 ||
            EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, TAG, h + HDR + blen) != 1)
            rc = -1;
        lens[i] = (uint32_t)(HDR + blen + TAG);
    }
    EVP_CIPHER_CTX_free(c);
    return rc;
}

/* Authenticate and decrypt one datagram of len bytes (>= HDR + TAG) in place with context c
 * (its key set): 1 when it opened; 0 when forged, and then no plaintext is left behind. */
static int open_slot(EVP_CIPHER_CTX *c, unsigned char *slot, uint32_t len) {
    unsigned char nonce[12], tag[TAG];
    int outl = 0, finl = 0, clen = (int)(len - HDR - TAG);
    memcpy(tag, slot + HDR + clen, TAG);
    nonce_of(slot, nonce);
    if (EVP_DecryptInit_ex(c, NULL, NULL, NULL, nonce) == 1 && EVP_DecryptUpdate(c, NULL, &outl, slot, HDR) == 1 &&
        EVP_DecryptUpdate(c, slot + HDR, &outl, slot + HDR, clen) == 1 &&
        EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_SET_TAG, TAG, tag) == 1 && EVP_DecryptFinal_ex(c, slot + HDR + outl, &finl) == 1)
        return 1;
    memset(slot + HDR, 0, (size_t)clen);
    return 0;
}

/* Authenticate and decrypt n datagrams in place: slot i of buf holds lens[i] bytes; keys[i]
 * is its round's key (NULL: not opened). On success the plaintext replaces the ciphertext
 * (at slot offset 43, lens[i] - 59 bytes) and ok[i] = 1; else ok[i] = 0 (forged, wrong key,
 * or too short). Returns the number authenticated. */
int dg_open(int n, void **keys, unsigned char *buf, uint32_t stride, const uint32_t *lens, unsigned char *ok) {
    int good = 0;
    const dg_aead *cur = NULL;
    EVP_CIPHER_CTX *c = NULL;
    for (int i = 0; i < n; i++) {
        dg_aead *a = keys[i];
        unsigned char *slot = buf + (size_t)i * stride;
        uint32_t len = lens[i];
        ok[i] = 0;
        if (!a || len < HDR + TAG || len > stride) continue;
        if (a != cur) { /* rows of one round are usually together: one context per run of a key */
            EVP_CIPHER_CTX_free(c);
            c = ctx_for(a, 0);
            cur = c ? a : NULL;
            if (!c) continue;
        }
        ok[i] = (unsigned char)open_slot(c, slot, len);
        good += ok[i];
    }
    EVP_CIPHER_CTX_free(c);
    return good;
}

/* Check and open n datagrams of one round in place: what dg_open does, plus the header checks
 * that come before authentication and the replay check after it, in the order Opener.open makes
 * them, each row's outcome in status[i] (DG_*). skip (NULL: none) marks rows to leave alone; a row
 * of another round is left sealed (DG_OTHER_ROUND) for the caller's general path. key is the
 * round's key; magic (2 bytes), version, run, round and num_members are what the header must say;
 * rings[s] and nexts[s] are sender s's replay window (datagram_wire.ReplayWindow: `window` slots,
 * each seq + 1 at seq % window, and the highest seq + 1, 0 for none), updated here. Returns the
 * number opened. Header fields are little-endian on the wire (datagram_wire.HEADER), read byte by
 * byte. */
enum {
    DG_OK = 0,
    DG_SKIP = 1,
    DG_OVERSIZED = 2,
    DG_TRUNCATED = 3,
    DG_BAD_MAGIC = 4,
    DG_BAD_VERSION = 5,
    DG_WRONG_RUN = 6,
    DG_OTHER_ROUND = 7,
    DG_BAD_SENDER = 8,
    DG_FORGED = 9,
    DG_REPLAYED = 10,
};

/* ReplayWindow.check_and_add: 1 (and remembered) when seq was not seen and is inside the window
 * of `window` slots below the highest seq seen (next - 1); unsigned arithmetic, no overflow. The
 * top value is refused: seq + 1 would wrap to 0 and reset the window (a key holder may seal it). */
static int replay_new(uint64_t *ring, uint64_t *next, uint32_t window, uint64_t seq) {
    if (seq == UINT64_MAX) return 0;
    if (*next > window && seq < *next - window) return 0;
    uint64_t *slot = ring + seq % window;
    if (*slot == seq + 1) return 0;
    *slot = seq + 1;
    if (seq >= *next) *next = seq + 1;
    return 1;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int dg_open_round(int n, void *key, unsigned char *buf, uint32_t stride, const uint32_t *lens,
                  const unsigned char *skip, uint32_t max_len, const unsigned char *magic, uint32_t version,
                  uint32_t run, uint32_t round, uint32_t num_members, uint64_t *const *rings,
                  uint64_t *const *nexts, uint32_t window, unsigned char *status) {
    int good = 0;
    EVP_CIPHER_CTX *c = NULL;
    for (int i = 0; i < n; i++) {
        unsigned char *slot = buf + (size_t)i * stride;
        uint32_t len = lens[i];
        if (skip && skip[i]) {
            status[i] = DG_SKIP;
            continue;
        }
        if (len > max_len || len > stride) {
            status[i] = DG_OVERSIZED;
            continue;
        }
        if (len < HDR + TAG) {
            status[i] = DG_TRUNCATED;
            continue;
        }
        if (slot[0] != magic[0] || slot[1] != magic[1]) {
            status[i] = DG_BAD_MAGIC;
            continue;
        }
        if (slot[2] != version) {
            status[i] = DG_BAD_VERSION;
            continue;
        }
        if (le32(slot + 4) != run) {
            status[i] = DG_WRONG_RUN;
            continue;
        }
        if (le32(slot + 8) != round) {
            status[i] = DG_OTHER_ROUND;
            continue;
        }
        uint32_t sender = (uint32_t)slot[29] | (uint32_t)slot[30] << 8;
        if (sender >= num_members) {
            status[i] = DG_BAD_SENDER;
            continue;
        }
        status[i] = DG_FORGED;
        if (!c && !(c = ctx_for(key, 0))) continue;
        if (!open_slot(c, slot, len)) continue;
        uint64_t seq = 0;
        for (int b = 7; b >= 0; b--) seq = seq << 8 | slot[31 + b];
        if (!replay_new(rings[sender], nexts[sender], window, seq)) {
            status[i] = DG_REPLAYED;
            continue;
        }
        status[i] = DG_OK;
        good++;
    }
    EVP_CIPHER_CTX_free(c);
    return good;
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--) v = v << 8 | p[b];
    return v;
}

/* The columns of an opened batch whose rows 0..n-1 are all whole data datagrams of one kind:
 * kind `kind` (CONTRIB: a contribution; MEAN: a mean chunk), one fragment, round `round`,
 * codec < num_codecs, sender < num_members, at least HDR + lead + TAG bytes, where `lead`
 * (1..8) is the body's bytes before the codec payload: 8 for a contribution (its claim), the
 * senders bitmap's for a mean chunk. Returns 0 when a row is not (nothing else is meaningful;
 * also for a lead outside 1..8), else the number of senders, their ids in the order of their
 * first rows in order[].
 *   cols[i * 8 + k]: row i's sender, bucket, chunk, offset, numel, codec, sequence, lead (its
 *   `lead` bytes as a little-endian integer: the claim, or the bitmap);
 *   t[i]: its arrival, ts_ns[i] * 1e-9 + offset_s, or now_s when the socket gave none (0);
 *   at[i], width[i]: where its codec payload lies in blob and its bytes (blob: the rows'
 *   payloads back to back, in row order);
 *   per sender s (arrays of num_members; only the senders in order[] are written):
 *   rows[s] its row count, first[s] its first row, bytes[s] its plaintext bytes (lead
 *   included), tmin[s] / tmax[s] its earliest and latest arrival, ascending[s] 1 when its
 *   sequence numbers rise row by row, uniform[s] 1 when its rows share codec and lead. */
int dg_plain_batch(int n, const unsigned char *buf, uint32_t stride, const uint32_t *lens, const int64_t *ts_ns,
                   double offset_s, double now_s, uint32_t kind, uint32_t round, uint32_t num_codecs,
                   uint32_t num_members, uint32_t lead, int64_t *cols, double *t, int64_t *at, int64_t *width, unsigned char *blob,
                   int32_t *order, int32_t *rows, int32_t *first, int64_t *bytes, double *tmin, double *tmax,
                   unsigned char *ascending, unsigned char *uniform) {
    if (lead < 1 || lead > 8) return 0;
    for (int i = 0; i < n; i++) {
        const unsigned char *h = buf + (size_t)i * stride;
        uint32_t len = lens[i];
        if (len > stride || len < HDR + lead + TAG || h[3] != kind || le32(h + 8) != round || h[28] >= num_codecs ||
            ((uint32_t)h[41] | (uint32_t)h[42] << 8) != 1 || ((uint32_t)h[29] | (uint32_t)h[30] << 8) >= num_members)
            return 0;
    }
    int senders = 0;
    int64_t pos = 0;
    for (int i = 0; i < n; i++) {
        const unsigned char *h = buf + (size_t)i * stride;
        int64_t *c = cols + (size_t)i * 8;
        uint32_t s = (uint32_t)h[29] | (uint32_t)h[30] << 8;
        c[0] = s;
        c[1] = le32(h + 12);
        c[2] = le32(h + 16);
        c[3] = le32(h + 20);
        c[4] = le32(h + 24);
        c[5] = h[28];
        c[6] = (int64_t)le64(h + 31);
        uint64_t v = 0;
        for (int b = (int)lead - 1; b >= 0; b--) v = v << 8 | h[HDR + b];
        c[7] = (int64_t)v;
        t[i] = ts_ns[i] ? (double)ts_ns[i] * 1e-9 + offset_s : now_s;
        int64_t w = (int64_t)lens[i] - (HDR + lead + TAG);
        at[i] = pos;
        width[i] = w;
        memcpy(blob + pos, h + HDR + lead, (size_t)w);
        pos += w;
        int new_sender = 1;
        for (int k = 0; k < senders; k++)
            if ((uint32_t)order[k] == s) {
                new_sender = 0;
                break;
            }
        if (new_sender) {
            order[senders++] = (int32_t)s;
            rows[s] = 0;
            first[s] = i;
            bytes[s] = 0;
            tmin[s] = tmax[s] = t[i];
            ascending[s] = 1;
            uniform[s] = 1;
        } else {
            const int64_t *c0 = cols + (size_t)first[s] * 8;
            if (c[5] != c0[5] || c[7] != c0[7]) uniform[s] = 0;
            if (t[i] < tmin[s]) tmin[s] = t[i];
            if (t[i] > tmax[s]) tmax[s] = t[i];
        }
        rows[s]++;
        bytes[s] += (int64_t)lens[i] - (HDR + TAG);
    }
    /* rising sequence numbers, per sender: each row's against the sender's previous row */
    for (int k = 0; k < senders; k++) {
        int32_t s = order[k];
        uint64_t prev = 0;
        int seen = 0;
        for (int i = first[s]; i < n && ascending[s]; i++) {
            const int64_t *c = cols + (size_t)i * 8;
            if (c[0] != s) continue;
            if (seen && (uint64_t)c[6] <= prev) ascending[s] = 0;
            prev = (uint64_t)c[6];
            seen = 1;
        }
    }
    return senders;
}

/* Send slots 0..n-1 of buf (stride bytes apart, lens[i] bytes each) on the connected socket
 * fd with sendmmsg, repeating until all left or an error. Returns the number sent, or -errno
 * when none could be (ECONNREFUSED: the port is closed; EAGAIN/ENOBUFS: a full queue). */
int dg_send(int fd, int n, const unsigned char *buf, uint32_t stride, const uint32_t *lens) {
    struct mmsghdr msgs[MAX_BATCH];
    struct iovec iov[MAX_BATCH];
    int sent = 0;
    if (n > MAX_BATCH) n = MAX_BATCH;
    memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)n);
    for (int i = 0; i < n; i++) {
        iov[i].iov_base = (void *)(buf + (size_t)i * stride);
        iov[i].iov_len = lens[i];
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    while (sent < n) {
        int r = sendmmsg(fd, msgs + sent, (unsigned)(n - sent), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return sent ? sent : -errno;
        }
        sent += r;
    }
    return sent;
}

/* dg_send with UDP segmentation offload: each run of datagrams of one length (a shorter one
 * closes a run), at most GSO_MAX_SEGS and GSO_MAX_BYTES, leaves in one sendmsg with a UDP_SEGMENT
 * control message of that length, its rows gathered by an iovec each (no copy); the kernel (or
 * the NIC) cuts it into the same datagrams sendmmsg would send, in the same order. A run of one
 * goes without the control message. When the kernel refuses UDP_SEGMENT (EINVAL, EIO,
 * ENOPROTOOPT, EOPNOTSUPP: no GSO, or a device without checksum offload), *gso_errno gets the
 * errno and the rest of the batch goes through dg_send. Returns the number sent, or -errno. */
int dg_send_gso(int fd, int n, const unsigned char *buf, uint32_t stride, const uint32_t *lens, int *gso_errno) {
    struct iovec iov[GSO_MAX_SEGS];
    char ctl[CMSG_SPACE(sizeof(uint16_t))];
    int sent = 0;
    *gso_errno = 0;
    if (n > MAX_BATCH) n = MAX_BATCH;
    while (sent < n) {
        uint32_t seg = lens[sent];
        size_t total = 0;
        int k = 0;
        while (sent + k < n && k < GSO_MAX_SEGS) {
            uint32_t l = lens[sent + k];
            if (l > seg || total + l > GSO_MAX_BYTES) break;
            iov[k].iov_base = (void *)(buf + (size_t)(sent + k) * stride);
            iov[k].iov_len = l;
            total += l;
            k++;
            if (l < seg) break; /* a shorter datagram can only be a run's last segment */
        }
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)k;
        if (k > 1) {
            memset(ctl, 0, sizeof(ctl));
            m.msg_control = ctl;
            m.msg_controllen = sizeof(ctl);
            struct cmsghdr *c = CMSG_FIRSTHDR(&m);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t size = (uint16_t)seg;
            memcpy(CMSG_DATA(c), &size, sizeof(size));
        }
        ssize_t r;
        do {
            r = sendmsg(fd, &m, 0);
        } while (r < 0 && errno == EINTR);
        if (r < 0) {
            int e = errno;
            if (k > 1 && (e == EINVAL || e == EIO || e == ENOPROTOOPT || e == EOPNOTSUPP)) {
                *gso_errno = e;
                int rest = dg_send(fd, n - sent, buf + (size_t)sent * stride, stride, lens + sent);
                return rest < 0 ? (sent ? sent : rest) : sent + rest;
            }
            return sent ? sent : -e;
        }
        sent += k;
    }
    return sent;
}

#define CTL_BYTES 96 /* a read's control room: a timestamp, a drop count and a UDP_GRO size */

/* recvmmsg of at most n reads without blocking, read i into base + i * slot_stride (slot_len
 * bytes) with ctl[i] as its control room. Returns the reads, 0 when none was queued, or -errno. */
static int recv_slots(int fd, int n, struct mmsghdr *msgs, struct iovec *iov, char (*ctl)[CTL_BYTES],
                      unsigned char *base, size_t slot_stride, size_t slot_len) {
    memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)n);
    for (int i = 0; i < n; i++) {
        iov[i].iov_base = base + (size_t)i * slot_stride;
        iov[i].iov_len = slot_len;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_control = ctl[i];
        msgs[i].msg_hdr.msg_controllen = CTL_BYTES;
    }
    int r;
    do {
        r = recvmmsg(fd, msgs, (unsigned)n, MSG_DONTWAIT, NULL);
    } while (r < 0 && errno == EINTR);
    if (r < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -errno;
    return r;
}

/* A read's control messages: its arrival (*ts_ns, CLOCK_REALTIME ns from SO_TIMESTAMPNS; 0
 * without), the socket's drop count (*drops, SO_RXQ_OVFL, when reported) and its datagrams'
 * size when the kernel coalesced it (*gro_size, UDP_GRO; 0 without). */
static void read_meta(struct msghdr *m, int64_t *ts_ns, uint32_t *drops, uint32_t *gro_size) {
    *ts_ns = 0;
    *gro_size = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof(size));
            if (size > 0) *gro_size = (uint32_t)size;
        } else if (c->cmsg_level != SOL_SOCKET) {
            continue;
        } else if (c->cmsg_type == SCM_TIMESTAMPNS && c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
            struct timespec t;
            memcpy(&t, CMSG_DATA(c), sizeof(t));
            *ts_ns = (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
        } else if (c->cmsg_type == SO_RXQ_OVFL && c->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
            memcpy(drops, CMSG_DATA(c), sizeof(uint32_t));
        }
    }
}

/* Receive at most n datagrams without blocking into slots of buf (stride bytes; a longer
 * datagram is cut and reported as stride + 1 bytes, so the caller sees it oversized).
 * lens[i]: its length; ts_ns[i]: its arrival at the socket (CLOCK_REALTIME ns, from
 * SO_TIMESTAMPNS; 0 when the socket gives none); *drops: the socket's count of datagrams
 * dropped at a full buffer (SO_RXQ_OVFL), updated when the kernel reports it.
 * Returns the number received (0: none queued), or -errno. */
int dg_recv(int fd, int n, unsigned char *buf, uint32_t stride, uint32_t *lens, int64_t *ts_ns, uint32_t *drops) {
    struct mmsghdr msgs[MAX_BATCH];
    struct iovec iov[MAX_BATCH];
    static __thread char ctl[MAX_BATCH][CTL_BYTES];
    if (n > MAX_BATCH) n = MAX_BATCH;
    int r = recv_slots(fd, n, msgs, iov, ctl, buf, stride, stride);
    for (int i = 0; i < r; i++) {
        uint32_t gro_size;
        lens[i] = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ? stride + 1 : msgs[i].msg_len;
        read_meta(&msgs[i].msg_hdr, &ts_ns[i], drops, &gro_size);
    }
    return r;
}

/* What dg_recv_gro read but has not yet cut into rows: GRO_SLOTS reads of at most
 * GRO_SLOT_BYTES each (len: its bytes, seg: its datagrams' size, the last one may be
 * shorter; ts_ns: its arrival), of which reads [at, count) are left, from byte pos of read at.
 * One per receiving socket, used by one thread. */
typedef struct {
    unsigned char *scratch;
    uint32_t len[GRO_SLOTS], seg[GRO_SLOTS];
    int64_t ts_ns[GRO_SLOTS];
    int count, at;
    uint32_t pos;
    uint64_t reads, datagrams; /* so far: reads taken from the socket, datagrams cut from them */
} dg_gro;

void *dg_gro_new(void) {
    dg_gro *g = calloc(1, sizeof(*g));
    if (!g) return NULL;
    g->scratch = malloc((size_t)GRO_SLOTS * GRO_SLOT_STRIDE);
    if (!g->scratch) {
        free(g);
        return NULL;
    }
    return g;
}

void dg_gro_free(void *p) {
    dg_gro *g = p;
    if (!g) return;
    free(g->scratch);
    free(g);
}

/* 1 when reads are left to cut into rows (the next dg_recv_gro returns them without a
 * system call), else 0: the caller may wait for the socket only at 0. */
int dg_gro_pending(const void *p) {
    const dg_gro *g = p;
    return g->at < g->count;
}

/* out[0]: reads taken from the socket so far, out[1]: datagrams cut from them. */
void dg_gro_stats(const void *p, uint64_t *out) {
    const dg_gro *g = p;
    out[0] = g->reads;
    out[1] = g->datagrams;
}

/* Cut what g holds into rows [*row, n) of buf: dg_recv's row contract (a datagram longer
 * than stride is cut and reported as stride + 1 bytes). */
static void gro_cut(dg_gro *g, int *row, int n, unsigned char *buf, uint32_t stride, uint32_t *lens, int64_t *ts_ns) {
    while (*row < n && g->at < g->count) {
        int k = g->at;
        uint32_t left = g->len[k] - g->pos;
        uint32_t l = left < g->seg[k] ? left : g->seg[k];
        memcpy(buf + (size_t)*row * stride, g->scratch + (size_t)k * GRO_SLOT_STRIDE + g->pos, l < stride ? l : stride);
        lens[*row] = l > stride ? stride + 1 : l;
        ts_ns[*row] = g->ts_ns[k];
        (*row)++;
        g->datagrams++;
        g->pos += l;
        if (g->pos >= g->len[k] || l == 0) {
            g->at++;
            g->pos = 0;
        }
    }
}

/* dg_recv on a socket with UDP_GRO set: the kernel hands runs of equal-sized datagrams of
 * one flow over as one coalesced read (a UDP_GRO control message gives their size), up to
 * GRO_SLOTS reads per recvmmsg; each is cut back into its datagrams, one per row, in
 * order, all with the read's arrival time. What does not fit the n rows stays in g for the
 * next call (dg_gro_pending). A read without the control message is one datagram. Fills
 * rows until n or the socket is empty: fewer than n rows means the socket was found empty
 * and g holds nothing. Returns the rows filled, or -errno when the first read failed (an
 * error after rows were filled ends the call with them; the next call meets it). */
int dg_recv_gro(void *p, int fd, int n, unsigned char *buf, uint32_t stride, uint32_t *lens, int64_t *ts_ns,
                uint32_t *drops) {
    dg_gro *g = p;
    struct mmsghdr msgs[GRO_SLOTS];
    struct iovec iov[GRO_SLOTS];
    static __thread char ctl[GRO_SLOTS][CTL_BYTES];
    int row = 0;
    if (n > MAX_BATCH) n = MAX_BATCH;
    gro_cut(g, &row, n, buf, stride, lens, ts_ns);
    while (row < n) {
        int r = recv_slots(fd, GRO_SLOTS, msgs, iov, ctl, g->scratch, GRO_SLOT_STRIDE, GRO_SLOT_BYTES);
        if (r <= 0) return row ? row : r;
        for (int i = 0; i < r; i++) {
            uint32_t len = msgs[i].msg_len, seg;
            read_meta(&msgs[i].msg_hdr, &g->ts_ns[i], drops, &seg);
            if (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) { /* cannot happen below 64 KiB: one oversized datagram */
                len = GRO_SLOT_BYTES;
                seg = 0;
            }
            g->len[i] = len;
            g->seg[i] = seg && seg < len ? seg : (len ? len : 1);
        }
        g->count = r;
        g->reads += (uint64_t)r;
        g->at = 0;
        g->pos = 0;
        gro_cut(g, &row, n, buf, stride, lens, ts_ns);
    }
    return row;
}
