/* The datagram data path's per-datagram work in batches: seal, open, send, receive.
 *
 * Loaded with ctypes by dtrain/transports/datagram_native.py, which builds it once per
 * source hash with gcc against OpenSSL's libcrypto. Python hands over whole batches (up
 * to a few hundred datagrams) in flat buffers: one datagram per slot of `stride` bytes.
 * ctypes releases the GIL for the call, so sealing, authentication and the system calls
 * run beside the Python threads.
 *
 * The wire format is datagram_wire.py's: a 43-byte header that is the AEAD's associated
 * data, then the body sealed with ChaCha20-Poly1305 (RFC 8439) and its 16-byte tag. The
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
#include <time.h>

#include <openssl/evp.h>

#define HDR 43
#define TAG 16
#define MAX_BATCH 1024

int dg_version(void) { return 1; }

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
    if (c && EVP_CipherInit_ex(c, EVP_chacha20_poly1305(), NULL, a->key, NULL, enc) != 1) {
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

/* Seal n datagrams. hdrs: n complete 43-byte headers back to back (sequence numbers set);
 * body: the plaintexts back to back, datagram i's at [off[i], off[i+1]). Slot i of out
 * (stride bytes) receives header | ciphertext | tag and lens[i] its length.
 * Returns n, or -1 when a slot is too small or the cipher fails (nothing is usable then). */
int dg_seal(void *p, int n, const unsigned char *hdrs, const unsigned char *body, const uint64_t *off,
            unsigned char *out, uint32_t stride, uint32_t *lens) {
    unsigned char nonce[12];
    EVP_CIPHER_CTX *c = ctx_for(p, 1);
    int rc = n;
    if (!c) return -1;
    for (int i = 0; i < n && rc == n; i++) {
        const unsigned char *h = hdrs + (size_t)i * HDR;
        uint64_t blen = off[i + 1] - off[i];
        unsigned char *slot = out + (size_t)i * stride;
        int outl = 0, finl = 0;
        if (HDR + blen + TAG > stride) {
            rc = -1;
            break;
        }
        memcpy(slot, h, HDR);
        nonce_of(h, nonce);
        if (EVP_EncryptInit_ex(c, NULL, NULL, NULL, nonce) != 1 || EVP_EncryptUpdate(c, NULL, &outl, h, HDR) != 1 ||
            EVP_EncryptUpdate(c, slot + HDR, &outl, body + off[i], (int)blen) != 1 ||
            EVP_EncryptFinal_ex(c, slot + HDR + outl, &finl) != 1 ||
            EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_GET_TAG, TAG, slot + HDR + blen) != 1)
            rc = -1;
        lens[i] = (uint32_t)(HDR + blen + TAG);
    }
    EVP_CIPHER_CTX_free(c);
    return rc;
}

/* Authenticate and decrypt n datagrams in place: slot i of buf holds lens[i] bytes; keys[i]
 * is its round's key (NULL: not opened). On success the plaintext replaces the ciphertext
 * (at slot offset 43, lens[i] - 59 bytes) and ok[i] = 1; else ok[i] = 0 (forged, wrong key,
 * or too short). Returns the number authenticated. */
int dg_open(int n, void **keys, unsigned char *buf, uint32_t stride, const uint32_t *lens, unsigned char *ok) {
    unsigned char nonce[12], tag[TAG];
    int good = 0;
    const dg_aead *cur = NULL;
    EVP_CIPHER_CTX *c = NULL;
    for (int i = 0; i < n; i++) {
        dg_aead *a = keys[i];
        unsigned char *slot = buf + (size_t)i * stride;
        uint32_t len = lens[i];
        int outl = 0, finl = 0, clen;
        ok[i] = 0;
        if (!a || len < HDR + TAG || len > stride) continue;
        if (a != cur) { /* rows of one round are usually together: one context per run of a key */
            EVP_CIPHER_CTX_free(c);
            c = ctx_for(a, 0);
            cur = c ? a : NULL;
            if (!c) continue;
        }
        clen = (int)(len - HDR - TAG);
        memcpy(tag, slot + HDR + clen, TAG);
        nonce_of(slot, nonce);
        if (EVP_DecryptInit_ex(c, NULL, NULL, NULL, nonce) != 1 || EVP_DecryptUpdate(c, NULL, &outl, slot, HDR) != 1 ||
            EVP_DecryptUpdate(c, slot + HDR, &outl, slot + HDR, clen) != 1 ||
            EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_AEAD_SET_TAG, TAG, tag) != 1)
            continue;
        if (EVP_DecryptFinal_ex(c, slot + HDR + outl, &finl) == 1) {
            ok[i] = 1;
            good++;
        } else {
            /* a forged datagram leaves no plaintext behind */
            memset(slot + HDR, 0, (size_t)clen);
        }
    }
    EVP_CIPHER_CTX_free(c);
    return good;
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

/* Receive at most n datagrams without blocking into slots of buf (stride bytes; a longer
 * datagram is cut and reported as stride + 1 bytes, so the caller sees it oversized).
 * lens[i]: its length; ts_ns[i]: its arrival at the socket (CLOCK_REALTIME ns, from
 * SO_TIMESTAMPNS; 0 when the socket gives none); *drops: the socket's count of datagrams
 * dropped at a full buffer (SO_RXQ_OVFL), updated when the kernel reports it.
 * Returns the number received (0: none queued), or -errno. */
int dg_recv(int fd, int n, unsigned char *buf, uint32_t stride, uint32_t *lens, int64_t *ts_ns, uint32_t *drops) {
    struct mmsghdr msgs[MAX_BATCH];
    struct iovec iov[MAX_BATCH];
    static __thread char ctl[MAX_BATCH][64];
    if (n > MAX_BATCH) n = MAX_BATCH;
    memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)n);
    for (int i = 0; i < n; i++) {
        iov[i].iov_base = buf + (size_t)i * stride;
        iov[i].iov_len = stride;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_control = ctl[i];
        msgs[i].msg_hdr.msg_controllen = sizeof(ctl[i]);
    }
    int r;
    do {
        r = recvmmsg(fd, msgs, (unsigned)n, MSG_DONTWAIT, NULL);
    } while (r < 0 && errno == EINTR);
    if (r < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -errno;
    for (int i = 0; i < r; i++) {
        struct msghdr *m = &msgs[i].msg_hdr;
        lens[i] = (m->msg_flags & MSG_TRUNC) ? stride + 1 : msgs[i].msg_len;
        ts_ns[i] = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
            if (c->cmsg_level != SOL_SOCKET) continue;
            if (c->cmsg_type == SCM_TIMESTAMPNS && c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
                struct timespec t;
                memcpy(&t, CMSG_DATA(c), sizeof(t));
                ts_ns[i] = (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
            } else if (c->cmsg_type == SO_RXQ_OVFL && c->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
                memcpy(drops, CMSG_DATA(c), sizeof(uint32_t));
            }
        }
    }
    return r;
}
