//! Batched host copies for the hit path: the copier moves every tensor of a task from its
//! buffer slot in one call, instead of one ctypes call (~0.5-1 us each) per tensor.
const std = @import("std");
const assert = std.debug.assert;
const constants = @import("constants.zig");

/// The C library's `memmove` (or `memcpy`), passed in by the caller: tuned per CPU and size,
/// it beats compiler-rt's generic `@memcpy` by a few % on 256 KiB copies, and the library is
/// not linked against libc to reach it directly.
pub const CopyFn = *const fn (target: [*]u8, source: [*]const u8, length_bytes: usize) callconv(.c) ?*anyopaque;

/// Copies `lengths_bytes[i]` bytes from `sources[i]` to `targets[i]`, in order, with `copy_fn`
/// when given. Ranges must not overlap (slot memory and destination tensors never do).
pub fn copy_ranges(targets: []const usize, sources: []const usize, lengths_bytes: []const usize, copy_fn: ?CopyFn) void {
    assert(targets.len == sources.len and sources.len == lengths_bytes.len);
    assert(targets.len <= constants.copy_ranges_max);
    for (targets, sources, lengths_bytes) |target, source, length_bytes| {
        if (length_bytes == 0) continue;
        assert(target != 0 and source != 0);
        const to: [*]u8 = @ptrFromInt(target);
        const from: [*]const u8 = @ptrFromInt(source);
        if (copy_fn) |copy| {
            _ = copy(to, from, length_bytes);
        } else {
            @memcpy(to[0..length_bytes], from[0..length_bytes]);
        }
    }
}

fn test_copy(target: [*]u8, source: [*]const u8, length_bytes: usize) callconv(.c) ?*anyopaque {
    @memcpy(target[0..length_bytes], source[0..length_bytes]);
    return target;
}

test "copy_ranges: every range lands at its target, zero lengths are skipped" {
    var source: [64]u8 = undefined;
    for (&source, 0..) |*byte, index| byte.* = @intCast(index);
    for ([_]?CopyFn{ null, &test_copy }) |copy_fn| {
        var target = [_]u8{0xee} ** 64;
        const targets = [_]usize{ @intFromPtr(&target[40]), 0, @intFromPtr(&target[0]) };
        const sources = [_]usize{ @intFromPtr(&source[0]), 0, @intFromPtr(&source[10]) };
        const lengths_bytes = [_]usize{ 8, 0, 30 };
        copy_ranges(&targets, &sources, &lengths_bytes, copy_fn);
        try std.testing.expectEqualSlices(u8, source[10..40], target[0..30]);
        try std.testing.expectEqualSlices(u8, &([_]u8{0xee} ** 10), target[30..40]);
        try std.testing.expectEqualSlices(u8, source[0..8], target[40..48]);
        try std.testing.expectEqualSlices(u8, &([_]u8{0xee} ** 16), target[48..64]);
    }
}
