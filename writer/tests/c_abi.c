/* A C program using libsluice_writer.so through its header, as a non-Python trainer would
 * (writer/tests/c_abi.rs compiles and runs it): writes DIR/out in pieces of odd sizes, closes it,
 * checks the bytes, checks that errors come back as negative errno values with a message, and
 * prints the cuFile probe's answer. Exits 0 when everything held. */
#include "sluice_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned char byte_at(size_t i) { return (unsigned char)((i * 2654435761u) >> 24); }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    char path[4096];
    snprintf(path, sizeof path, "%s/out", argv[1]);
    const size_t total = (3u << 20) + 4097; /* several 1 MiB blocks and an unaligned tail */
    unsigned char *data = malloc(total);
    for (size_t i = 0; i < total; i++) data[i] = byte_at(i);

    sluice_writer *w = sluice_writer_open(path, 1 << 20);
    if (!w) { fprintf(stderr, "open: %s\n", sluice_writer_last_error()); return 1; }
    for (size_t at = 0, piece = 1; at < total; piece = piece * 3 + 1) {
        size_t n = piece < total - at ? piece : total - at;
        int rc = sluice_writer_write(w, data + at, n);
        if (rc != 0) { fprintf(stderr, "write: %d %s\n", rc, sluice_writer_last_error()); return 1; }
        at += n;
    }
    if (sluice_writer_position(w) != (int64_t)total) { fprintf(stderr, "position\n"); return 1; }
    int direct = sluice_writer_is_direct(w);
    if (sluice_writer_close(w) != 0) { fprintf(stderr, "close: %s\n", sluice_writer_last_error()); return 1; }

    FILE *f = fopen(path, "rb");
    unsigned char *back = malloc(total + 1);
    size_t got = fread(back, 1, total + 1, f);
    fclose(f);
    if (got != total || memcmp(back, data, total) != 0) { fprintf(stderr, "bytes differ (%zu read)\n", got); return 1; }

    /* Four writer threads: the same bytes. */
    char path4[4096];
    snprintf(path4, sizeof path4, "%s/out4", argv[1]);
    sluice_writer *w4 = sluice_writer_open_threads(path4, 1 << 16, 4);
    if (!w4) { fprintf(stderr, "open_threads: %s\n", sluice_writer_last_error()); return 1; }
    for (size_t at = 0; at < total; at += 100000) {
        size_t n = total - at < 100000 ? total - at : 100000;
        if (sluice_writer_write(w4, data + at, n) != 0) { fprintf(stderr, "write4: %s\n", sluice_writer_last_error()); return 1; }
    }
    if (sluice_writer_close(w4) != 0) { fprintf(stderr, "close4: %s\n", sluice_writer_last_error()); return 1; }
    f = fopen(path4, "rb");
    got = fread(back, 1, total + 1, f);
    fclose(f);
    if (got != total || memcmp(back, data, total) != 0) { fprintf(stderr, "4 threads: bytes differ\n"); return 1; }
    /* An aborted file leaves nothing under its name. */
    char gone[4096];
    snprintf(gone, sizeof gone, "%s/aborted", argv[1]);
    sluice_writer *wa = sluice_writer_open_threads(gone, 0, 2);
    if (!wa || sluice_writer_write(wa, data, 5000) != 0) return 1;
    sluice_writer_abort(wa);
    if (fopen(gone, "rb") != NULL) { fprintf(stderr, "an aborted file has its name\n"); return 1; }
    /* Too many threads: refused, saying what to choose. */
    if (sluice_writer_open_threads(gone, 0, 65) != NULL) return 1;
    if (strstr(sluice_writer_last_error(), "choose 1 to 64") == NULL) { fprintf(stderr, "%s\n", sluice_writer_last_error()); return 1; }

    /* Errors: a negative errno and a message naming the file. */
    if (sluice_writer_open("/nonexistent-sluice-dir/x", 0) != NULL) return 1;
    if (strstr(sluice_writer_last_error(), "/nonexistent-sluice-dir/x") == NULL) return 1;
    if (sluice_writer_write(NULL, data, 1) != -EINVAL) return 1;
    /* CUDA memory where cuFile was not probed available: refused, nothing written. */
    sluice_writer *w2 = sluice_writer_open(path, 0);
    int rc = sluice_writer_write_cuda(w2, data, 4096);
    sluice_writer_abort(w2);

    char why[256];
    int avail = sluice_cufile_probe(NULL, 1000, why, sizeof why);
    printf("ok %zu bytes, direct=%d, write_cuda=%d, probe=%d %s, version %s\n", total, direct, rc, avail,
           why, sluice_writer_version());
    return 0;
}
