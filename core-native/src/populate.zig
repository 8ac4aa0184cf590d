//! Background population of a data mapping: open returns at once, and native threads fault the
//! data plane in behind it, chunk by chunk, with MADV_POPULATE_WRITE.
//!
//! Why: the first write to a tmpfs/memfd page costs ~1.3 GB/s here (allocation, zeroing and a
//! 4 KiB fault), so pre-faulting at open made open time grow with capacity (1.9 s per GiB). A
//! slot that is not populated yet still serves correct bytes: a page is allocated (zeroed) on
//! its first touch, whoever touches it. Population only moves that cost off the hot path.
//!
//! The creator's populater allocates the shared pages; an attaching rank's only fills its own
//! page tables for pages that exist already (and allocates the rest, whichever rank gets there
//! first). Writers that must not meet an allocation failure as a SIGBUS (the native queue
//! before it copies into a slot) call `ensure` on their range first: MADV_POPULATE_WRITE
//! reports a shortage as an errno.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const sys = @import("seg_sys.zig");

const assert = std.debug.assert;
const Atomic = std.atomic.Value;

pub const madvise_populate_write: u32 = 23;

pub const Populater = struct {
    base: usize = 0,
    bytes: usize = 0,
    chunk_count: u32 = 0,
    threads: [constants.populate_threads_max]std.Thread = undefined,
    thread_count: u32 = 0,
    /// The next chunk a thread takes.
    next_chunk: Atomic(u32) = Atomic(u32).init(0),
    /// Chunks fully populated (by the threads; `ensure` of part of a chunk does not count).
    chunks_done: Atomic(u32) = Atomic(u32).init(0),
    /// Bit c set: chunk c is populated in this process's mapping.
    done_bits: [constants.populate_chunks_max / 64]Atomic(u64) = @splat(Atomic(u64).init(0)),
    stop: Atomic(bool) = Atomic(bool).init(false),
    /// The first errno a populate call returned (0 if none); the threads stop at it.
    error_code: Atomic(u32) = Atomic(u32).init(0),
    started_ns: u64 = 0,
    /// Monotonic time the last chunk finished (0 while running or never started).
    finished_ns: Atomic(u64) = Atomic(u64).init(0),

    /// Prepares population of `[base, base + bytes)` without starting any thread.
    pub fn init(populater: *Populater, base: usize, bytes: usize) void {
        assert(populater.thread_count == 0);
        assert(base % constants.seg_page_bytes == 0);
        assert(bytes % constants.seg_page_bytes == 0);
        const chunk_count = std.math.divCeil(usize, bytes, constants.populate_chunk_bytes) catch unreachable;
        assert(chunk_count <= constants.populate_chunks_max);
        populater.* = .{ .base = base, .bytes = bytes, .chunk_count = @intCast(chunk_count) };
    }

    /// Starts `thread_count` threads (at most populate_threads_max); 0 starts none (lazy).
    /// Returns how many started (thread creation may fail under resource limits: lazy then).
    pub fn start(populater: *Populater, thread_count: u32) u32 {
        assert(populater.thread_count == 0);
        assert(thread_count <= constants.populate_threads_max);
        populater.started_ns = sys.monotonic_ns();
        var index: u32 = 0;
        while (index < thread_count) : (index += 1) {
            populater.threads[index] = std.Thread.spawn(.{}, run, .{populater}) catch break;
            populater.threads[index].setName("ucm-populate") catch {}; // for `top -H`
            populater.thread_count = index + 1;
        }
        return populater.thread_count;
    }

    /// Stops the threads (each finishes its current chunk) and joins them. Idempotent.
    pub fn stop_and_join(populater: *Populater) void {
        // Monotonic: a standalone flag; join() orders everything the threads did before exit.
        populater.stop.store(true, .monotonic);
        for (populater.threads[0..populater.thread_count]) |thread| thread.join();
        populater.thread_count = 0;
    }

    fn run(populater: *Populater) void {
        sys.block_signals();
        var taken: u32 = 0;
        while (taken <= populater.chunk_count) : (taken += 1) {
            if (populater.stop.load(.monotonic)) return;
            if (populater.error_code.load(.monotonic) != 0) return;
            // Monotonic: the counter only hands out distinct chunk numbers.
            const chunk = populater.next_chunk.fetchAdd(1, .monotonic);
            if (chunk >= populater.chunk_count) return;
            const range = populater.chunk_range(chunk);
            const err = populate_range(range.address, range.bytes);
            if (err != .SUCCESS) {
                _ = populater.error_code.cmpxchgStrong(0, @intFromEnum(err), .monotonic, .monotonic);
                return;
            }
            // Release: a reader that sees the bit (acquire) knows the pages are in.
            _ = populater.done_bits[chunk / 64].fetchOr(@as(u64, 1) << @intCast(chunk % 64), .release);
            const done = populater.chunks_done.fetchAdd(1, .acq_rel) + 1;
            if (done == populater.chunk_count) populater.finished_ns.store(sys.monotonic_ns(), .release);
        }
    }

    fn chunk_range(populater: *const Populater, chunk: u32) struct { address: usize, bytes: usize } {
        assert(chunk < populater.chunk_count);
        const offset = @as(usize, chunk) * constants.populate_chunk_bytes;
        const bytes = @min(constants.populate_chunk_bytes, populater.bytes - offset);
        assert(bytes > 0 and bytes % constants.seg_page_bytes == 0);
        return .{ .address = populater.base + offset, .bytes = bytes };
    }

    fn chunk_done(populater: *const Populater, chunk: u32) bool {
        assert(chunk < populater.chunk_count);
        // Acquire: pairs with the release fetchOr in `run`.
        return populater.done_bits[chunk / 64].load(.acquire) & (@as(u64, 1) << @intCast(chunk % 64)) != 0;
    }

    /// Makes `[address, address + length)` (inside the mapping) resident before a write, so that
    /// a shortage of shared memory is an errno here rather than a SIGBUS in a copy. Cheap when
    /// the populater has passed the range (one bit test per chunk).
    pub fn ensure(populater: *const Populater, address: usize, length: usize) linux.E {
        if (length == 0) return .SUCCESS;
        assert(address >= populater.base);
        assert(address - populater.base + length <= populater.bytes);
        const offset = address - populater.base;
        const first: u32 = @intCast(offset / constants.populate_chunk_bytes);
        const last: u32 = @intCast((offset + length - 1) / constants.populate_chunk_bytes);
        var chunk = first;
        var all_done = true;
        while (chunk <= last) : (chunk += 1) {
            if (!populater.chunk_done(chunk)) all_done = false;
        }
        if (all_done) return .SUCCESS;
        const page_start = std.mem.alignBackward(usize, address, constants.seg_page_bytes);
        const page_end = std.mem.alignForward(usize, address + length, constants.seg_page_bytes);
        return populate_range(page_start, page_end - page_start);
    }

    pub const Progress = extern struct {
        /// Bytes of this process's mapping the threads have populated.
        populated_bytes: u64,
        mapping_bytes: u64,
        threads: u32,
        /// errno of the first failed populate call, 0 if none.
        error_code: u32,
        /// Nanoseconds from start to the last chunk (0 while running).
        elapsed_ns: u64,
    };

    pub fn progress(populater: *const Populater) Progress {
        const done = populater.chunks_done.load(.acquire);
        assert(done <= populater.chunk_count);
        const finished = populater.finished_ns.load(.acquire);
        var populated = @as(u64, done) * constants.populate_chunk_bytes;
        if (done == populater.chunk_count) populated = populater.bytes;
        return .{
            .populated_bytes = @min(populated, populater.bytes),
            .mapping_bytes = populater.bytes,
            .threads = populater.thread_count,
            .error_code = populater.error_code.load(.monotonic),
            .elapsed_ns = if (finished == 0) 0 else finished - populater.started_ns,
        };
    }
};

/// MADV_POPULATE_WRITE over a page-aligned range; on kernels before 5.14 (EINVAL) a write per
/// page instead (which can only report a shortage as SIGBUS: those kernels have no better way).
/// That write is a compare-and-swap of a byte with itself (`touch_pages`).
pub fn populate_range(address: usize, bytes: usize) linux.E {
    assert(address % constants.seg_page_bytes == 0);
    assert(bytes % constants.seg_page_bytes == 0);
    const rc = linux.madvise(@ptrFromInt(address), bytes, madvise_populate_write);
    const err = sys.errno(rc);
    if (err != .INVAL) return err;
    touch_pages(address, bytes);
    return .SUCCESS;
}

/// Write-faults every page of a range without changing a byte. Population runs after the
/// segment is published, while other ranks write slots, so a plain load-then-store could put
/// back a byte one of them had just written. A compare-and-swap of the byte with itself is a
/// locked write that stores nothing new: if another rank wrote in between, it fails and that
/// rank's write has faulted the page already. (An atomic add of zero could be lowered to a
/// plain load, which would not fault the page for writing.) Monotonic: it orders nothing.
pub fn touch_pages(address: usize, bytes: usize) void {
    assert(address % constants.seg_page_bytes == 0);
    assert(bytes % constants.seg_page_bytes == 0);
    const page_count = bytes / constants.seg_page_bytes;
    var page: usize = 0;
    while (page < page_count) : (page += 1) {
        const byte: *u8 = @ptrFromInt(address + page * constants.seg_page_bytes);
        const value = @atomicLoad(u8, byte, .monotonic);
        _ = @cmpxchgStrong(u8, byte, value, value, .monotonic, .monotonic);
    }
}

test "touch_pages (the fallback before MADV_POPULATE_WRITE) allocates every page, changes no byte" {
    const page_count = 8;
    const bytes = page_count * constants.seg_page_bytes;
    const fd_rc = linux.memfd_create("ucm-touch-test", linux.MFD.CLOEXEC);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(fd_rc));
    const fd: i32 = @intCast(fd_rc);
    defer sys.close_fd(fd);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.ftruncate(fd, @intCast(bytes))));
    const map_rc = linux.mmap(null, bytes, linux.PROT.READ | linux.PROT.WRITE, .{ .TYPE = .SHARED }, fd, 0);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(map_rc));
    defer _ = linux.munmap(@ptrFromInt(map_rc), bytes);
    const memory: [*]u8 = @ptrFromInt(map_rc);
    memory[3 * constants.seg_page_bytes] = 0xa5; // one page already written by "another rank"
    touch_pages(map_rc, bytes);
    var st: linux.Stat = undefined;
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.fstat(fd, &st)));
    try std.testing.expectEqual(@as(i64, @intCast(bytes / 512)), st.blocks);
    for (0..bytes) |i| {
        const expected: u8 = if (i == 3 * constants.seg_page_bytes) 0xa5 else 0;
        try std.testing.expectEqual(expected, memory[i]);
    }
}

test "populater threads fault every chunk in and report progress; ensure is exact" {
    const bytes = 3 * constants.populate_chunk_bytes + 5 * constants.seg_page_bytes;
    const fd_rc = linux.memfd_create("ucm-populate-test", linux.MFD.CLOEXEC);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(fd_rc));
    const fd: i32 = @intCast(fd_rc);
    defer sys.close_fd(fd);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.ftruncate(fd, @intCast(bytes))));
    const map_rc = linux.mmap(null, bytes, linux.PROT.READ | linux.PROT.WRITE, .{ .TYPE = .SHARED }, fd, 0);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(map_rc));
    defer _ = linux.munmap(@ptrFromInt(map_rc), bytes);
    var st: linux.Stat = undefined;
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.fstat(fd, &st)));
    try std.testing.expectEqual(@as(i64, 0), st.blocks); // nothing allocated by the open

    var populater: Populater = .{};
    populater.init(map_rc, bytes);
    // `ensure` of a range before any thread ran allocates exactly that range's pages.
    try std.testing.expectEqual(linux.E.SUCCESS, populater.ensure(map_rc + 10, 2 * constants.seg_page_bytes));
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.fstat(fd, &st)));
    try std.testing.expectEqual(@as(i64, 3 * constants.seg_page_bytes / 512), st.blocks);

    try std.testing.expectEqual(@as(u32, 2), populater.start(2));
    var polls: u32 = 0;
    while (populater.progress().elapsed_ns == 0 and polls < 10_000) : (polls += 1) {
        std.Thread.sleep(std.time.ns_per_ms);
    }
    populater.stop_and_join();
    const report = populater.progress();
    try std.testing.expectEqual(@as(u64, bytes), report.populated_bytes);
    try std.testing.expectEqual(@as(u32, 0), report.error_code);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.fstat(fd, &st)));
    try std.testing.expectEqual(@as(i64, @intCast(bytes / 512)), st.blocks);
    try std.testing.expectEqual(linux.E.SUCCESS, populater.ensure(map_rc + bytes - 1, 1));
}

test "stop_and_join returns promptly and leaves the rest to lazy faults" {
    const bytes = 64 * constants.populate_chunk_bytes;
    const map_rc = linux.mmap(null, bytes, linux.PROT.READ | linux.PROT.WRITE, .{ .TYPE = .SHARED, .ANONYMOUS = true }, -1, 0);
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(map_rc));
    defer _ = linux.munmap(@ptrFromInt(map_rc), bytes);
    var populater: Populater = .{};
    populater.init(map_rc, bytes);
    _ = populater.start(1);
    populater.stop_and_join();
    try std.testing.expect(populater.progress().populated_bytes <= bytes);
    // An unpopulated page still reads as zero and takes writes (a lazy fault).
    const last: *u8 = @ptrFromInt(map_rc + bytes - 1);
    try std.testing.expectEqual(@as(u8, 0), last.*);
    last.* = 9;
    try std.testing.expectEqual(@as(u8, 9), last.*);
}
