#!/usr/bin/env python3
"""Builds a GPT dataset's indices as Megatron-LM does (megatron/core/datasets/gpt_dataset.py
with helpers.cpp's build_sample_idx: numpy.random.RandomState(seed) shuffles of the document
index and the shuffle index, the last epoch apart when it is used less than 80%) and compares
them, values and dtypes, with the .npy files Tessera cached.

usage: megatron_gpt_indices.py PREFIX FIRST END NUM_SAMPLES SEQ_LENGTH SEED CACHE_DIR SPLIT
Prints "match" and exits 0, or describes the first difference and exits 1; exits 77 when
numpy is not installed.
"""
import glob
import struct
import sys

try:
    import numpy
except ImportError:
    sys.exit(77)


def sequence_lengths(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    (count,) = struct.unpack_from("<Q", idx, 18)
    return numpy.frombuffer(idx, dtype=numpy.int32, count=count, offset=34)


def megatron_indices(sizes, first, end, num_samples, seq, seed):
    documents = numpy.arange(first, end, dtype=numpy.int32)
    tokens_per_epoch = int(sizes[first:end].sum())
    epochs, tokens = 1, tokens_per_epoch
    while tokens < num_samples * seq + 1:
        epochs += 1
        tokens += tokens_per_epoch
    separate = False
    if epochs > 1:
        before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq
        per_epoch = (tokens_per_epoch - 1) // seq
        separate = num_samples - before_final < int(0.80 * per_epoch)
    rng = numpy.random.RandomState(seed)

    def document_index(n_epochs, apart):
        if not apart or n_epochs == 1:
            grid = numpy.mgrid[0:n_epochs, 0 : len(documents)][1]
            grid[:] = documents
            out = grid.reshape(-1).astype(numpy.int32)
            rng.shuffle(out)
            return out
        return numpy.concatenate((document_index(n_epochs - 1, False), document_index(1, False)))

    doc_index = document_index(epochs, separate)

    samples = (epochs * tokens_per_epoch - 1) // seq
    narrow = max(len(doc_index), int(sizes.max())) <= numpy.iinfo(numpy.int32).max
    sample_index = numpy.zeros((samples + 1, 2), dtype=numpy.int32 if narrow else numpy.int64)
    position, offset = 0, 0
    for k in range(1, samples + 1):
        remaining = seq + 1
        while remaining != 0:
            length = int(sizes[doc_index[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            elif position == len(doc_index) - 1:
                offset = int(sizes[doc_index[position]]) - 1
                break
            else:
                position += 1
                offset = 0
        sample_index[k] = (position, offset)

    def shuffle_index(first_part, total):
        dtype = numpy.int64 if total >= numpy.iinfo(numpy.uint32).max - 1 else numpy.uint32
        head = numpy.arange(0, first_part, dtype=dtype)
        rng.shuffle(head)
        if first_part == total:
            return head
        tail = numpy.arange(first_part, total, dtype=dtype)
        rng.shuffle(tail)
        return numpy.concatenate((head, tail))

    shuffle = shuffle_index(before_final if separate else samples, samples)
    return {"document_index": doc_index, "sample_index": sample_index, "shuffle_index": shuffle}


def main():
    prefix, first, end, num_samples, seq, seed, cache_dir, split = sys.argv[1:9]
    expected = megatron_indices(sequence_lengths(prefix), int(first), int(end), int(num_samples),
                                int(seq), int(seed))
    entries = glob.glob("%s/*-GPTDataset-%s-description.txt" % (cache_dir, split))
    if len(entries) != 1:
        print("expected one cache entry in %s, found %d" % (cache_dir, len(entries)))
        return 1
    base = entries[0][: -len("description.txt")]
    for name, want in expected.items():
        got = numpy.load(base + name + ".npy")
        if got.dtype != want.dtype or got.shape != want.shape or not numpy.array_equal(got, want):
            print("%s differs: Tessera %s %s %s, Megatron %s %s %s" % (
                name, got.dtype, got.shape, got[:8], want.dtype, want.shape, want[:8]))
            return 1
    print("match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
