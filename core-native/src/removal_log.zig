//! The removal log: a monotonically increasing removal generation and a fixed ring of the
//! latest removals (a purge of a namespace, or a forced remove of one block), so that a write
//! to a lower tier that was under way while a removal cleared that tier can find out, once
//! its bytes have landed, that it must remove them again.
//!
//! It lives in the CacheBuffer's control plane (every process of the node appends and reads
//! the same ring) or, for a stack without a buffer, in one process's memory. It holds no
//! pointers. Appends never wait and never take a lock; a reader copies the entries of a
//! window of generations and learns whether the window is still complete in the ring.
//!
//! An entry is a seqlock of its own: an appender claims generation g (fetchAdd), zeroes the
//! entry's `generation` word, writes kind and id, then stores g. A reader that sees g in the
//! word before and after reading the fields read g's fields, untorn: every access is SeqCst,
//! so an overwriter's zeroing store precedes its field stores in the one total order, and a
//! reader who saw any of those field stores sees the zero (or a later generation) after.
const std = @import("std");
const constants = @import("constants.zig");
const assert = std.debug.assert;
const Atomic = std.atomic.Value;

pub const Kind = enum(u64) {
    /// Every key of a namespace: `id`'s first 8 bytes are the namespace's tag, the rest zero.
    purge = 1,
    /// Every shard of one block: `id` is the block's scoped id.
    remove = 2,
};

pub const Id = [16]u8;

pub const Entry = extern struct {
    /// The entry's generation; 0 while it is written (or never written).
    generation: Atomic(u64),
    kind: Atomic(u64),
    id_low: Atomic(u64),
    id_high: Atomic(u64),
};

/// What a reader copies out per entry (no atomics).
pub const Record = extern struct {
    generation: u64,
    kind: u64,
    id: Id,
};

pub const Log = extern struct {
    /// The latest generation handed out (0: nothing removed yet).
    generation: Atomic(u64),
    _pad: [constants.removal_log_header_size_bytes - 8]u8,
    entries: [constants.removal_log_entries]Entry,

    /// A fresh log (the memory must be zeroed or initialised by this).
    pub fn init(log: *Log) void {
        log.generation.store(0, .seq_cst);
        for (&log.entries) |*entry| {
            entry.generation.store(0, .seq_cst);
        }
    }

    /// The latest generation; a writer reads it before the data it writes is captured.
    /// SeqCst: ordered with the appends' fetchAdd and the entries' words in the one total order.
    pub fn current(log: *const Log) u64 {
        return log.generation.load(.seq_cst);
    }

    /// Records a removal; returns its generation (at least 1).
    pub fn append(log: *Log, kind: Kind, id: Id) u64 {
        // SeqCst: the generation is handed out before the entry is written, and a reader that
        // sees it covers the entry (published below or found incomplete, which fails closed).
        const generation = log.generation.fetchAdd(1, .seq_cst) + 1;
        assert(generation > 0);
        const entry = &log.entries[index_of(generation)];
        // SeqCst throughout: the seqlock argument in the module comment needs the zeroing to
        // precede the field stores, and the final store to follow them, for every reader.
        entry.generation.store(0, .seq_cst);
        entry.kind.store(@intFromEnum(kind), .seq_cst);
        entry.id_low.store(std.mem.readInt(u64, id[0..8], .little), .seq_cst);
        entry.id_high.store(std.mem.readInt(u64, id[8..16], .little), .seq_cst);
        entry.generation.store(generation, .seq_cst);
        return generation;
    }

    pub const Window = struct {
        /// Entries copied into `out` (generations since+1 .. latest, in order).
        count: u32,
        /// The latest generation when the window was read.
        latest: u64,
        /// False when some entry of the window was no longer (or not yet) readable: the
        /// ring wrapped past it, or its appender had not finished it. A reader fails closed.
        complete: bool,
    };

    /// Copies the removals with generations in (since, latest] into `out`, at most
    /// `out.len`; a window longer than that, or than the ring, is incomplete.
    pub fn read(log: *const Log, since: u64, out: []Record) Window {
        const latest = log.current();
        if (latest <= since) return .{ .count = 0, .latest = latest, .complete = latest == since };
        const span = latest - since;
        if (span > constants.removal_log_entries or span > out.len) {
            return .{ .count = 0, .latest = latest, .complete = false };
        }
        var count: u32 = 0;
        var generation = since + 1;
        // Bounded: span <= removal_log_entries.
        while (generation <= latest) : (generation += 1) {
            const entry = &log.entries[index_of(generation)];
            const before = entry.generation.load(.seq_cst);
            const kind = entry.kind.load(.seq_cst);
            const low = entry.id_low.load(.seq_cst);
            const high = entry.id_high.load(.seq_cst);
            const after = entry.generation.load(.seq_cst);
            if (before != generation or after != generation) {
                return .{ .count = count, .latest = latest, .complete = false };
            }
            var record = Record{ .generation = generation, .kind = kind, .id = undefined };
            std.mem.writeInt(u64, record.id[0..8], low, .little);
            std.mem.writeInt(u64, record.id[8..16], high, .little);
            out[count] = record;
            count += 1;
        }
        assert(count == span);
        return .{ .count = count, .latest = latest, .complete = true };
    }

    fn index_of(generation: u64) usize {
        return @intCast(generation & (constants.removal_log_entries - 1));
    }
};

comptime {
    assert(@sizeOf(Entry) == constants.removal_log_entry_size_bytes);
    assert(@sizeOf(Log) == constants.removal_log_size_bytes);
    assert(@offsetOf(Log, "entries") == constants.removal_log_header_size_bytes);
    assert(@sizeOf(Record) == 32);
}

// ---- Tests ----

fn test_id(value: u64) Id {
    var id: Id = @splat(0);
    std.mem.writeInt(u64, id[0..8], value, .little);
    std.mem.writeInt(u64, id[8..16], ~value, .little);
    return id;
}

test "removal log: appends are read back in order, windows are exact" {
    const log = try std.testing.allocator.create(Log);
    defer std.testing.allocator.destroy(log);
    log.init();
    var out: [16]Record = undefined;
    var window = log.read(0, &out);
    try std.testing.expectEqual(@as(u32, 0), window.count);
    try std.testing.expect(window.complete);
    try std.testing.expectEqual(@as(u64, 1), log.append(.purge, test_id(7)));
    try std.testing.expectEqual(@as(u64, 2), log.append(.remove, test_id(8)));
    window = log.read(0, &out);
    try std.testing.expectEqual(@as(u32, 2), window.count);
    try std.testing.expect(window.complete);
    try std.testing.expectEqual(@as(u64, 2), window.latest);
    try std.testing.expectEqual(@as(u64, @intFromEnum(Kind.purge)), out[0].kind);
    try std.testing.expectEqualSlices(u8, &test_id(7), &out[0].id);
    try std.testing.expectEqualSlices(u8, &test_id(8), &out[1].id);
    window = log.read(1, &out);
    try std.testing.expectEqual(@as(u32, 1), window.count);
    try std.testing.expectEqual(@as(u64, 2), out[0].generation);
    // A window longer than the caller's room is incomplete, never silently cut.
    window = log.read(0, out[0..1]);
    try std.testing.expect(!window.complete);
}

test "removal log: model-based, random appends and windows against a reference" {
    const log = try std.testing.allocator.create(Log);
    defer std.testing.allocator.destroy(log);
    log.init();
    var model: std.ArrayList(Record) = .empty;
    defer model.deinit(std.testing.allocator);
    var out = try std.testing.allocator.alloc(Record, constants.removal_log_read_max);
    defer std.testing.allocator.free(out);
    var prng = std.Random.DefaultPrng.init(0x5eed_1095);
    const random = prng.random();
    var step: u32 = 0;
    while (step < 20_000) : (step += 1) {
        if (random.uintLessThan(u32, 3) != 0) {
            const kind: Kind = if (random.boolean()) .purge else .remove;
            const id = test_id(random.int(u64));
            const generation = log.append(kind, id);
            try std.testing.expectEqual(@as(u64, model.items.len + 1), generation);
            try model.append(std.testing.allocator, .{ .generation = generation, .kind = @intFromEnum(kind), .id = id });
        } else {
            const latest: u64 = model.items.len;
            const since = latest -| random.uintLessThan(u64, 2 * constants.removal_log_entries);
            const window = log.read(since, out);
            try std.testing.expectEqual(latest, window.latest);
            const span = latest - since;
            if (span > constants.removal_log_entries) {
                try std.testing.expect(!window.complete);
                continue;
            }
            try std.testing.expect(window.complete);
            try std.testing.expectEqual(span, window.count);
            for (out[0..window.count], model.items[@intCast(since)..]) |got, want| {
                try std.testing.expectEqual(want.generation, got.generation);
                try std.testing.expectEqual(want.kind, got.kind);
                try std.testing.expectEqualSlices(u8, &want.id, &got.id);
            }
        }
    }
}

test "removal log: an entry being written makes the window incomplete" {
    const log = try std.testing.allocator.create(Log);
    defer std.testing.allocator.destroy(log);
    log.init();
    _ = log.append(.remove, test_id(1));
    // An appender that claimed generation 2 and died (or is still writing) before publishing.
    _ = log.generation.fetchAdd(1, .seq_cst);
    var out: [4]Record = undefined;
    const window = log.read(0, &out);
    try std.testing.expect(!window.complete);
    try std.testing.expectEqual(@as(u32, 1), window.count);
    // A reader whose window starts after it is not affected.
    const later = log.read(2, &out);
    try std.testing.expect(later.complete);
}

test "removal log: concurrent appenders and a reader never see a torn entry" {
    const log = try std.testing.allocator.create(Log);
    defer std.testing.allocator.destroy(log);
    log.init();
    const appends_per_thread: u32 = 20_000;
    const Appender = struct {
        fn run(target: *Log, seed: u64) void {
            var index: u32 = 0;
            while (index < appends_per_thread) : (index += 1) {
                const value = seed *% 1_000_003 +% index;
                _ = target.append(.remove, test_id(value));
            }
        }
    };
    var threads: [2]std.Thread = undefined;
    for (&threads, 0..) |*thread, index| {
        thread.* = try std.Thread.spawn(.{}, Appender.run, .{ log, @as(u64, index + 1) });
    }
    var out = try std.testing.allocator.alloc(Record, constants.removal_log_read_max);
    defer std.testing.allocator.free(out);
    var rounds: u32 = 0;
    while (rounds < 2_000) : (rounds += 1) {
        const since = log.current() -| 64;
        const window = log.read(since, out);
        for (out[0..window.count]) |record| {
            // test_id writes v and ~v: a torn entry would break the pair.
            const low = std.mem.readInt(u64, record.id[0..8], .little);
            const high = std.mem.readInt(u64, record.id[8..16], .little);
            try std.testing.expectEqual(~low, high);
        }
    }
    for (threads) |thread| thread.join();
    const window = log.read(log.current() - 100, out);
    try std.testing.expect(window.complete);
    try std.testing.expectEqual(@as(u32, 100), window.count);
    try std.testing.expectEqual(@as(u64, 2 * appends_per_thread), log.current());
}
