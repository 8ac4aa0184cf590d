//! Shard checksums for the lower tiers: XXH3-64 streamed over a shard's views (one view per
//! tensor), so a torn or corrupted copy on disk or in an object store is caught (and repaired
//! from a tier below) instead of being served.
//!
//! Why XXH3 rather than zlib's crc32: the posix tier checks every shard it loads, and at
//! NVMe speeds crc32 (~2 GB/s per core here) costs as much CPU as the read itself. XXH3 runs
//! at tens of GB/s; a random corruption goes unnoticed with probability 2^-64.
const std = @import("std");
const assert = std.debug.assert;
const constants = @import("constants.zig");

/// XXH3-64 of the concatenation of `parts`, with `seed`.
pub fn checksum_parts(seed: u64, parts: []const []const u8) u64 {
    assert(parts.len <= constants.checksum_parts_max);
    var state = std.hash.XxHash3.init(seed);
    for (parts) |part| state.update(part);
    return state.final();
}

/// The same over caller memory: `lengths_bytes[i]` bytes at `addresses[i]` (the C ABI form).
pub fn checksum_ranges(seed: u64, addresses: []const usize, lengths_bytes: []const usize) u64 {
    assert(addresses.len == lengths_bytes.len);
    assert(addresses.len <= constants.checksum_parts_max);
    var state = std.hash.XxHash3.init(seed);
    for (addresses, lengths_bytes) |address, length_bytes| {
        if (length_bytes == 0) continue;
        assert(address != 0);
        const part: [*]const u8 = @ptrFromInt(address);
        state.update(part[0..length_bytes]);
    }
    return state.final();
}

test "checksum: the XXH3-64 reference vector of the empty input" {
    // xxhsum -H3 of an empty file: 2d06800538d394c2.
    try std.testing.expectEqual(@as(u64, 0x2d06800538d394c2), checksum_parts(0, &.{}));
    try std.testing.expectEqual(@as(u64, 0x2d06800538d394c2), checksum_parts(0, &.{""}));
}

test "checksum: streaming over parts equals one pass over their concatenation" {
    var prng = std.Random.DefaultPrng.init(7);
    const random = prng.random();
    var bytes: [4096]u8 = undefined;
    random.bytes(&bytes);
    var round: u32 = 0;
    while (round < 200) : (round += 1) {
        const total = random.uintLessThan(usize, bytes.len + 1);
        const cut_a = random.uintLessThan(usize, total + 1);
        const cut_b = cut_a + random.uintLessThan(usize, total - cut_a + 1);
        const whole = std.hash.XxHash3.hash(round, bytes[0..total]);
        const parts = [_][]const u8{ bytes[0..cut_a], bytes[cut_a..cut_b], bytes[cut_b..total] };
        try std.testing.expectEqual(whole, checksum_parts(round, &parts));
    }
}

test "checksum: one flipped bit changes the digest" {
    var bytes = [_]u8{0x5a} ** 1024;
    const clean = checksum_parts(0, &.{&bytes});
    for (0..bytes.len * 8) |bit| {
        bytes[bit / 8] ^= @as(u8, 1) << @intCast(bit % 8);
        try std.testing.expect(checksum_parts(0, &.{&bytes}) != clean);
        bytes[bit / 8] ^= @as(u8, 1) << @intCast(bit % 8);
    }
    try std.testing.expectEqual(clean, checksum_parts(0, &.{&bytes}));
}

test "checksum: ranges agree with parts" {
    const a = "the first tensor's bytes";
    const b = "and the second's";
    const addresses = [_]usize{ @intFromPtr(a.ptr), 0, @intFromPtr(b.ptr) };
    const lengths_bytes = [_]usize{ a.len, 0, b.len };
    try std.testing.expectEqual(checksum_parts(3, &.{ a, b }), checksum_ranges(3, &addresses, &lengths_bytes));
}
