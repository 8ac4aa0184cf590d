//! Cross-process wait/wake on a 32-bit version word in shared memory.
//!
//! The protocol (seed §3.2, Scenario B): a waiter reads the version *before* it checks the state
//! it cares about, then blocks only while the version still equals what it read. The writer
//! publishes the state first, then increments the version, then wakes everyone. A completion
//! that lands between the waiter's "read version" and "block" changes the version, so the
//! kernel's compare in FUTEX_WAIT fails and the waiter returns at once: no lost wake-up, and no
//! polling. The futexes are non-private because the word is shared between processes.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");

const assert = std.debug.assert;

pub const WaitResult = enum(i32) {
    /// The version differs from the expected one (changed before or while we slept).
    changed = 0,
    /// The timeout expired and the version still equals the expected one.
    timed_out = 1,
};

/// Reads the version with acquire ordering: everything the writer stored before its release
/// increment is visible once we observe the new value.
pub fn load(word: *const std.atomic.Value(u32)) u32 {
    assert(@intFromPtr(word) % constants.futex_word_size_bytes == 0);
    return word.load(.acquire);
}

/// Blocks while `word == expected`, at most `timeout_ns` nanoseconds in total.
/// Spurious wake-ups and EINTR are absorbed; the loop is bounded by the deadline.
pub fn wait(word: *const std.atomic.Value(u32), expected: u32, timeout_ns: u64) WaitResult {
    assert(@intFromPtr(word) % constants.futex_word_size_bytes == 0);
    const start_ns = monotonic_ns();
    const deadline_ns = start_ns +| timeout_ns;
    // Each pass either returns or sleeps until the deadline, a wake-up or a signal; the number
    // of passes is bounded by the deadline because each pass re-reads the clock.
    var passes: u64 = 0;
    while (true) : (passes += 1) {
        assert(passes < std.math.maxInt(u32));
        // Acquire: pairs with the release increment in `bump`.
        if (word.load(.acquire) != expected) return .changed;
        const now_ns = monotonic_ns();
        if (now_ns >= deadline_ns) return .timed_out;
        const remaining_ns = deadline_ns - now_ns;
        const ts = linux.timespec{
            .sec = @intCast(remaining_ns / std.time.ns_per_s),
            .nsec = @intCast(remaining_ns % std.time.ns_per_s),
        };
        const rc = linux.futex_4arg(
            @ptrCast(&word.raw),
            .{ .cmd = .WAIT, .private = false },
            expected,
            &ts,
        );
        switch (linux.E.init(rc)) {
            .SUCCESS, .AGAIN, .INTR, .TIMEDOUT => {},
            else => |err| std.debug.panic("futex wait failed: {s}", .{@tagName(err)}),
        }
    }
}

/// Increments the version (release, so the state written before is published with it) and
/// wakes every waiter on the word. Returns the new version.
pub fn bump(word: *std.atomic.Value(u32)) u32 {
    const current = increment(word);
    _ = wake_all(word);
    return current;
}

/// The first half of `bump`: increments the version with release ordering, wakes nobody.
/// Returns the new version. Every increment must be followed by `wake_all` on the same word.
pub fn increment(word: *std.atomic.Value(u32)) u32 {
    assert(@intFromPtr(word) % constants.futex_word_size_bytes == 0);
    const previous = word.fetchAdd(1, .release);
    const current = previous +% 1;
    assert(current != previous);
    return current;
}

/// Wakes every process blocked on `word`. Returns the number woken (the kernel's count of
/// waiters it took off the word's queue).
pub fn wake_all(word: *const std.atomic.Value(u32)) u32 {
    assert(@intFromPtr(word) % constants.futex_word_size_bytes == 0);
    const rc = linux.futex_3arg(
        @ptrCast(&word.raw),
        .{ .cmd = .WAKE, .private = false },
        std.math.maxInt(i32),
    );
    switch (linux.E.init(rc)) {
        .SUCCESS => {},
        else => |err| std.debug.panic("futex wake failed: {s}", .{@tagName(err)}),
    }
    const woken: u32 = @intCast(rc);
    assert(woken <= std.math.maxInt(i32));
    return woken;
}

pub fn monotonic_ns() u64 {
    var ts: linux.timespec = undefined;
    const rc = linux.clock_gettime(.MONOTONIC, &ts);
    assert(linux.E.init(rc) == .SUCCESS);
    assert(ts.sec >= 0);
    return @as(u64, @intCast(ts.sec)) * std.time.ns_per_s + @as(u64, @intCast(ts.nsec));
}

test "wait returns at once when the version already changed" {
    var word = std.atomic.Value(u32).init(7);
    try std.testing.expectEqual(WaitResult.changed, wait(&word, 6, std.time.ns_per_s));
}

test "wait times out when nothing changes" {
    var word = std.atomic.Value(u32).init(3);
    const start_ns = monotonic_ns();
    try std.testing.expectEqual(WaitResult.timed_out, wait(&word, 3, 20 * std.time.ns_per_ms));
    try std.testing.expect(monotonic_ns() - start_ns >= 20 * std.time.ns_per_ms);
}

test "bump wakes a blocked thread" {
    var word = std.atomic.Value(u32).init(0);
    const Waiter = struct {
        fn run(w: *std.atomic.Value(u32), out: *WaitResult) void {
            out.* = wait(w, 0, 5 * std.time.ns_per_s);
        }
    };
    var result: WaitResult = .timed_out;
    const thread = try std.Thread.spawn(.{}, Waiter.run, .{ &word, &result });
    std.Thread.sleep(10 * std.time.ns_per_ms);
    try std.testing.expectEqual(@as(u32, 1), bump(&word));
    thread.join();
    try std.testing.expectEqual(WaitResult.changed, result);
}

test "wake_all returns how many blocked waiters it woke" {
    var word = std.atomic.Value(u32).init(0);
    try std.testing.expectEqual(@as(u32, 0), wake_all(&word)); // Nobody blocked yet.
    const Waiter = struct {
        fn run(w: *std.atomic.Value(u32), out: *WaitResult) void {
            out.* = wait(w, 0, 10 * std.time.ns_per_s);
        }
    };
    var results = [2]WaitResult{ .timed_out, .timed_out };
    var threads: [2]std.Thread = undefined;
    for (&threads, &results) |*thread, *result| {
        thread.* = try std.Thread.spawn(.{}, Waiter.run, .{ &word, result });
    }
    // A wake without a change sends the waiters straight back to sleep (the word still holds
    // what they expect), so probing until both were blocked at once is harmless.
    var both_seen = false;
    var probes: u32 = 0;
    while (probes < 500 and !both_seen) : (probes += 1) {
        std.Thread.sleep(10 * std.time.ns_per_ms);
        const woken = wake_all(&word);
        assert(woken <= 2);
        both_seen = woken == 2;
    }
    try std.testing.expect(both_seen);
    _ = bump(&word);
    for (threads) |thread| thread.join();
    try std.testing.expectEqualSlices(WaitResult, &.{ .changed, .changed }, &results);
}
