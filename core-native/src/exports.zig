//! The one C-ABI surface of libucm_core. Every exported symbol is prefixed `ucm_`, takes plain
//! integers and pointers, and never panics on caller input: bad input returns a negative code.
const std = @import("std");
const constants = @import("constants.zig");
const futex = @import("futex.zig");

pub const Error = enum(i32) {
    ok = 0,
    invalid_argument = -1,
};

export fn ucm_abi_version() u32 {
    return constants.abi_version;
}

/// Blocks while the 32-bit word at `word_addr` equals `expected`, up to `timeout_ns`.
/// Returns 0 when the word changed, 1 on timeout, a negative error on a bad address.
export fn ucm_version_wait(word_addr: usize, expected: u32, timeout_ns: u64) i32 {
    if (word_addr == 0 or word_addr % constants.futex_word_size_bytes != 0) {
        return @intFromEnum(Error.invalid_argument);
    }
    const word: *const std.atomic.Value(u32) = @ptrFromInt(word_addr);
    return @intFromEnum(futex.wait(word, expected, timeout_ns));
}

/// Increments the word at `word_addr` and wakes every waiter. Returns the new version as a
/// non-negative i64, or a negative error on a bad address.
export fn ucm_version_bump(word_addr: usize) i64 {
    if (word_addr == 0 or word_addr % constants.futex_word_size_bytes != 0) {
        return @intFromEnum(Error.invalid_argument);
    }
    const word: *std.atomic.Value(u32) = @ptrFromInt(word_addr);
    return futex.bump(word);
}

/// Reads the word at `word_addr` with acquire ordering.
export fn ucm_version_load(word_addr: usize) i64 {
    if (word_addr == 0 or word_addr % constants.futex_word_size_bytes != 0) {
        return @intFromEnum(Error.invalid_argument);
    }
    const word: *const std.atomic.Value(u32) = @ptrFromInt(word_addr);
    return futex.load(word);
}

export fn ucm_monotonic_ns() u64 {
    return futex.monotonic_ns();
}
