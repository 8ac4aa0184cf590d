//! The model-based fuzzer of the native load queue (queue.zig), over the harness of
//! queue_test.zig. `zig build test` runs fixed seeds and one fresh seed (`UCM_FUZZ_SEED`, else
//! random, printed as `queue fuzz: seed N, rounds M`); the long form, which replays a failure
//! exactly: `zig build fuzz -- queue --seed N --steps M` (M rounds).
const std = @import("std");
const buffer_module = @import("buffer.zig");
const queue_module = @import("queue.zig");
const queue_test = @import("queue_test.zig");
const buffer_fuzz = @import("buffer_fuzz.zig");

const Queue = queue_module.Queue;
const EntryResult = queue_module.EntryResult;
const Harness = queue_test.Harness;
const Call = queue_test.Call;
const block_id_of = queue_test.block_id_of;
const fill_pattern = queue_test.fill_pattern;
const matches_pattern = queue_test.matches_pattern;
const shard_size_bytes = queue_test.shard_size_bytes;
const BlockId = buffer_module.BlockId;
const expect_no_references = queue_test.expect_no_references;
const fake_processes = &queue_test.fake_processes;
const expect = std.testing.expect;
const expectEqual = std.testing.expectEqual;

// Model:
// Random tasks (loads, prefetches, dumps, no-fill and no-wait loads) from this process, often
// with a prefetch in the prefetch lane beside them (its own dispatcher, the same shard index,
// overlapping keys), interleaved with simulated other ranks that own keys and commit them
// Ready, Failed or Missing, or die while owning them; a loader that fails some keys. The
// model: the latest bytes dumped per key (pattern salt), and which keys the loader fails.
// Checked for every task: it completes within its bound; every entry has a final code; an
// `ok` load entry holds exactly the bytes its key has (the loader's pattern or the last
// dump's); failure codes are those the injected faults can produce (a no-wait load: only
// `missing`); a no-fill load alone evicts nothing; a load counts one hit or miss per key and
// prefetches none. At the end of each round this process holds no slot (no leak).

const fuzz_seeds = [_]u64{ 1, 7, 42, 1234 };
const fuzz_rounds = 60;
const fresh_rounds = 120;
const fuzz_blocks: u32 = 12;

/// What a run did: its queue's counters, summed over its buffers (with and without).
pub const Summary = struct {
    rounds: u64 = 0,
    /// Keys pinned while tasks ran (a pin holds only keys Ready in the buffer).
    pins: u64 = 0,
    counters: [queue_module.counter_count]u64 = @splat(0),
};

/// One seeded run: `rounds` rounds over a CacheBuffer, then `rounds / 4` (at least 1) over a
/// null buffer (every key BYPASS). Deterministic in what it submits; the threads interleave.
pub fn run(seed: u64, rounds: u64) !Summary {
    var summary = Summary{};
    try fuzz_seed(seed, rounds, false, &summary);
    try fuzz_seed(seed, @max(1, rounds / 4), true, &summary);
    return summary;
}

pub fn print_summary(summary: *const Summary) void {
    std.debug.print("  counters:", .{});
    for (summary.counters, 0..) |value, index| std.debug.print(" {s} {d}", .{ queue_module.counter_names[index], value });
    std.debug.print("\n", .{});
}

test "queue fuzzer: tasks always complete, ok entries are byte-exact, no slot leaks" {
    var summary = Summary{};
    for (fuzz_seeds) |seed| summary = add(summary, try run(seed, fuzz_rounds));
    const totals = summary.counters;
    // Every path of the state machine ran: hits, owners, waiters, takeovers of dead owners,
    // bypasses past a live owner, failures, dumps, prefetches, Prealloc.
    const exercised = [_]queue_module.Counter{ .hits, .owned, .waited, .takeovers, .bypassed, .failed_shards, .dumped_shards, .prefetched_shards, .prewarmed };
    for (exercised) |which| {
        if (totals[@intFromEnum(which)] == 0) std.debug.print("fuzzer never exercised {s}\n", .{@tagName(which)});
        try expect(totals[@intFromEnum(which)] > 0);
    }
    try expect(summary.pins > 0); // Pins held through tasks, evictions and dead ranks.
}

/// The simulated rank publishes what it owns: 1 Ready (with the key's bytes), 2 Failed,
/// 3 Missing; 0 does nothing (it is about to die).
fn finish_other(harness: *Harness, rank: usize, ending: u8, slots: []const u32, keys: []const u32) !void {
    if (ending == 0) return;
    for (slots, keys) |slot, key| {
        const state: buffer_module.State = switch (ending) {
            1 => .ready,
            2 => .failed,
            else => .missing,
        };
        if (state == .ready) fill_pattern(@ptrFromInt(harness.queue.slot_address_of(slot)), &block_id_of(key / 3), key % 3, 0);
        var out = [1]buffer_module.CommitResult{.ok};
        harness.others[rank].commit(&.{slot}, &.{@as(u8, @intCast(@intFromEnum(state)))}, &out);
        try expectEqual(buffer_module.CommitResult.ok, out[0]);
        _ = harness.others[rank].release(&.{slot});
    }
}

fn add(a: Summary, b: Summary) Summary {
    var sum = a;
    sum.rounds += b.rounds;
    sum.pins += b.pins;
    for (&sum.counters, b.counters) |*total, value| total.* += value;
    return sum;
}

test "queue fuzzer: one fresh seed (UCM_FUZZ_SEED, else random)" {
    const seed = try buffer_fuzz.fresh_seed();
    std.debug.print("queue fuzz: seed {d}, rounds {d}\n", .{ seed, fresh_rounds });
    _ = try run(seed, fresh_rounds);
}

fn fuzz_seed(seed: u64, rounds: u64, null_buffer: bool, summary: *Summary) !void {
    var prng = std.Random.DefaultPrng.init(seed);
    const random = prng.random();
    var harness: Harness = undefined;
    try harness.init(.{
        .null_buffer = null_buffer,
        .regular = random.intRangeAtMost(u32, 4, 24),
        .reserved = random.intRangeAtMost(u32, 0, 4),
        .slots_per_segment = random.intRangeAtMost(u32, 1, 8),
        .local_rank_size = random.intRangeAtMost(u32, 1, 4),
        .device_id = random.intRangeAtMost(u32, 0, 7),
        .step_keys = random.intRangeAtMost(u32, 1, 8),
        .copy_threads = random.intRangeAtMost(u32, 1, 4),
        .fill_parts = random.intRangeAtMost(u32, 1, 3),
        .wait_timeout_ns = 40 * std.time.ns_per_ms,
        .prealloc = random.boolean(),
        .rearrange = random.boolean(),
        .shards_per_block = 3,
    });
    defer harness.deinit();
    // A key's bytes never change (a KV block id names its content): every writer — the
    // loader, another rank, a dump — writes the key's own pattern, so an `ok` entry must hold
    // exactly that pattern (not another key's bytes, not stale slot bytes, not zeros).
    var round: u64 = 0;
    while (round < rounds) : (round += 1) {
        // A simulated rank: owns a few keys now; commits or dies while this rank's task runs.
        var other_slots: [3]u32 = undefined;
        var other_keys: [3]u32 = undefined;
        var other_count: usize = 0;
        const rank = random.uintLessThan(usize, 2);
        fake_processes[rank].alive = true;
        const others = random.uintLessThan(usize, 4);
        for (0..if (null_buffer) 0 else others) |_| {
            const key = random.uintLessThan(u32, fuzz_blocks * 3);
            var result = [1]buffer_module.GetResult{.hit};
            var slot = [1]u32{0};
            harness.others[rank].get(&.{block_id_of(key / 3)}, &.{key % 3}, .{ .results = &result, .slots = &slot });
            if (result[0] == .owner) {
                other_slots[other_count] = slot[0];
                other_keys[other_count] = key;
                other_count += 1;
            } else if (result[0] != .no_slot and result[0] != .lock_timeout and result[0] != .held) {
                _ = harness.others[rank].release(&slot);
            }
        }
        // Loader faults for this round.
        harness.lock.lock();
        harness.fail_keys.clearRetainingCapacity();
        if (random.boolean()) {
            const key = random.uintLessThan(u32, fuzz_blocks * 3);
            try harness.fail_keys.put(Harness.key_code(&block_id_of(key / 3), key % 3), {});
        }
        harness.lock.unlock();
        // This rank's task: distinct keys of one shard index.
        const shard = random.uintLessThan(u32, 3);
        var blocks: [fuzz_blocks]u32 = undefined;
        var count: usize = 0;
        for (0..fuzz_blocks) |block| {
            if (random.uintLessThan(u8, 3) == 0) {
                blocks[count] = @intCast(block);
                count += 1;
            }
        }
        if (count == 0) {
            blocks[0] = 0;
            count = 1;
        }
        var call = try Call.init(blocks[0..count], shard);
        defer call.deinit();
        var kind: queue_module.TaskKind = switch (random.uintLessThan(u8, 6)) {
            0 => .dump,
            1 => .prefetch,
            else => .load,
        };
        // A null buffer takes no dumps and no no-fill loads (the top tier holds the bytes).
        if (null_buffer and kind == .dump) kind = .load;
        const no_fill = kind == .load and random.uintLessThan(u8, 4) == 0 and !null_buffer;
        // An engine's synchronous load: not even another load's fill is waited for.
        const no_wait = no_fill and random.boolean();
        if (kind == .dump) call.with_pattern(0);
        if (kind == .load and random.uintLessThan(u8, 3) == 0) {
            // Some destinations copied by the caller (CUDA): handed out with their Ready slot.
            call.entry_flags = try queue_test.allocator.alloc(u8, count);
            for (call.entry_flags.?) |*flags| flags.* = if (random.boolean()) queue_module.entry_flag_caller_copy else 0;
        }
        const evictions_before = harness.base.counter_value(.evictions);
        const lookups_before = harness.queue.counter_value(.hits) + harness.queue.counter_value(.misses);
        const load_tasks_before = harness.queue.counter_value(.load_tasks);
        var flags: u32 = 0;
        if (no_fill) flags |= queue_module.task_flag_no_fill;
        if (no_wait) flags |= queue_module.task_flag_no_wait;
        const token = try call.submit(harness.queue, kind, flags);
        // The prefetch lane at the same time: some of the task's keys and others of the same
        // shard index, claimed (owned, waited on, filled) by two dispatchers at once.
        var side_blocks: [fuzz_blocks]u32 = undefined;
        var side_count: usize = 0;
        if (kind != .prefetch and random.boolean()) {
            for (0..fuzz_blocks) |block| {
                if (random.uintLessThan(u8, 3) != 0) continue;
                side_blocks[side_count] = @intCast(block);
                side_count += 1;
            }
        }
        var side = try Call.init(side_blocks[0..side_count], shard);
        defer side.deinit();
        const side_token: ?u64 = if (side_count > 0) try side.submit(harness.queue, .prefetch, 0) else null;
        // Pins taken while the task runs (this rank's other thread): up to two keys, any shard.
        var pin_keys: [2]u32 = undefined;
        var pin_ids: [2]BlockId = undefined;
        var pin_shards: [2]u32 = undefined;
        var pin_slots: [2]u32 = undefined;
        const pin_count = random.uintLessThan(usize, 3);
        for (0..pin_count) |i| {
            pin_keys[i] = random.uintLessThan(u32, fuzz_blocks * 3);
            pin_ids[i] = block_id_of(pin_keys[i] / 3);
            pin_shards[i] = pin_keys[i] % 3;
        }
        const pinned = harness.queue.pin(pin_ids[0..pin_count], pin_shards[0..pin_count], pin_slots[0..pin_count]);
        if (null_buffer) try expectEqual(@as(u32, 0), pinned);
        summary.pins += pinned;
        // The other rank finishes its loads (or dies) while the task runs.
        // 0: dies; 1-3: commits Ready, Failed or Missing now; 4: commits only after the task
        // (a live owner slower than the waiter's timeout: the waiter loads it from below).
        const ending = random.uintLessThan(u8, 5);
        std.Thread.sleep(random.uintLessThan(u64, 3) * std.time.ns_per_ms);
        if (ending != 4) try finish_other(&harness, rank, ending, other_slots[0..other_count], other_keys[0..other_count]);
        if (ending == 0) fake_processes[rank].alive = false;
        try expectEqual(@as(?bool, true), harness.queue.wait(token, 30 * std.time.ns_per_s));
        if (side_token) |side_task| try expectEqual(@as(?bool, true), harness.queue.wait(side_task, 30 * std.time.ns_per_s));
        if (ending == 4) try finish_other(&harness, rank, 1, other_slots[0..other_count], other_keys[0..other_count]);
        if (ending == 0) {
            _ = try harness.base.reclaim_dead();
            // The dead rank's entry is freed: register a new identity for that slot of the table.
            fake_processes[rank].start_time += 1;
            fake_processes[rank].alive = true;
            var view = harness.base;
            view.pid = fake_processes[rank].pid;
            view.holder = try harness.base.register_identity(view.pid, fake_processes[rank].start_time);
            harness.others[rank] = view;
        }
        // Nothing evicted while the dump ran: every key it reported done is Ready in the
        // buffer with its bytes, whatever another rank's fill of the same key did (Ready: the
        // same bytes; Failed or Missing: the dump wrote its own; died: taken over and written).
        const evicted = harness.base.counter_value(.evictions) != evictions_before;
        // A no-fill load only looks its keys up (no slot for a key it cannot copy): without a
        // prefetch beside it, nothing this round claimed a slot, so nothing was evicted.
        if (no_fill and side_token == null) try expect(!evicted);
        if (kind == .dump and !null_buffer and !evicted) {
            for (call.results, blocks[0..count]) |code, block| {
                if (@as(EntryResult, @enumFromInt(code)) != .ok) continue;
                const slot = (try harness.base.find_locked(&block_id_of(block), shard)) orelse return error.DumpedKeyMissing;
                try expectEqual(@intFromEnum(buffer_module.State.ready), harness.base.slots[slot].state.load(.acquire));
                const bytes: [*]const u8 = @ptrFromInt(harness.queue.slot_address_of(slot));
                try expect(matches_pattern(bytes[0..shard_size_bytes], &block_id_of(block), shard, 0));
            }
        }
        for (call.results, 0..) |code, i| {
            const result: EntryResult = @enumFromInt(code);
            try expect(result != .pending and result != .reported);
            switch (kind) {
                .dump => try expect(result == .ok or result == .no_slot),
                .prefetch => try expect(result == .ok or result == .caller_failed),
                .load => {
                    if (result == .ok) {
                        try expect(call.exact(i, 0));
                    } else if (no_wait) {
                        try expect(result == .missing);
                    } else if (no_fill) {
                        try expect(result == .missing or result == .owner_failed or result == .owner_missing);
                    } else {
                        try expect(result == .caller_failed or result == .owner_failed or result == .owner_missing);
                    }
                },
            }
        }
        for (side.results) |code| {
            const result: EntryResult = @enumFromInt(code);
            try expect(result == .ok or result == .caller_failed);
        }
        // Both tasks done: a load counted one hit or miss per key, a prefetch nothing.
        const lookups = harness.queue.counter_value(.hits) + harness.queue.counter_value(.misses) - lookups_before;
        try expectEqual(@as(u64, if (kind == .load) count else 0), lookups);
        try expectEqual(@as(u64, @intFromBool(kind == .load)), harness.queue.counter_value(.load_tasks) - load_tasks_before);
        // A pinned slot was never reused: it still holds its key's bytes, and is Ready.
        var unpin: [2]u32 = undefined;
        var unpin_count: usize = 0;
        for (pin_slots[0..pin_count], pin_keys[0..pin_count]) |slot, key| {
            if (slot == buffer_module.slot_none) continue;
            const bytes: [*]const u8 = @ptrFromInt(harness.queue.slot_address_of(slot));
            try expect(matches_pattern(bytes[0..shard_size_bytes], &block_id_of(key / 3), key % 3, 0));
            try expectEqual(@intFromEnum(buffer_module.State.ready), harness.base.slots[slot].state.load(.acquire));
            unpin[unpin_count] = slot;
            unpin_count += 1;
        }
        try expectEqual(@as(usize, pinned), unpin_count);
        try expect(harness.queue.unpin(unpin[0..unpin_count]));
        try expectEqual(@as(u32, 0), harness.queue.pinned);
        try expectEqual(@as(u32, 0), harness.queue.held_slot_count());
    }
    try expect(harness.queue.drain(10 * std.time.ns_per_s));
    try expect_no_references(&harness);
    summary.rounds += rounds;
    for (&summary.counters, 0..) |*total, index| total.* += harness.queue.counter_value(@enumFromInt(index));
}
