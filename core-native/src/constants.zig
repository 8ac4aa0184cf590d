//! Layout constants shared by every module of the native core. Anything that is part of the
//! shared-memory layout lives here so that a change is visible in one place and checked at
//! compile time.
const std = @import("std");

/// Bumped whenever the C ABI changes; the Python binding refuses a library with another value.
pub const abi_version: u32 = 1;

/// Futex words are 32-bit on Linux, and they must be naturally aligned.
pub const futex_word_size_bytes: usize = 4;

/// Upper bound on a single futex wait, so that a waiter always gets control back to check
/// whether the owner died (fault tolerance) even when asked to wait "forever".
pub const futex_wait_slice_ns: u64 = 100 * std.time.ns_per_ms;

comptime {
    std.debug.assert(@sizeOf(u32) == futex_word_size_bytes);
    std.debug.assert(@alignOf(std.atomic.Value(u32)) == futex_word_size_bytes);
    std.debug.assert(futex_wait_slice_ns > 0);
    std.debug.assert(futex_wait_slice_ns < std.time.ns_per_s);
}
