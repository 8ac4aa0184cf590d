//! Tests of the native load queue (queue.zig) over an in-memory CacheBuffer: hits, owners
//! filled by a loader thread, waiters on another (simulated) process's load, failures, a dead
//! owner taken over, no-fill loads, prefetch, Prealloc, dumps, caller copies, drain and stop;
//! its model-based fuzzer is queue_fuzz.zig, over the same harness.
const std = @import("std");
const builtin = @import("builtin");
const constants = @import("constants.zig");
const buffer_module = @import("buffer.zig");
const queue_module = @import("queue.zig");
const futex = @import("futex.zig");

const Buffer = buffer_module.Buffer;
const BlockId = buffer_module.BlockId;
const Queue = queue_module.Queue;
const EntryResult = queue_module.EntryResult;
const assert = std.debug.assert;
const expect = std.testing.expect;
const expectEqual = std.testing.expectEqual;

/// The testing allocator (leak checks) under `zig build test`; the page allocator in the
/// long-run fuzzer binary (`zig build fuzz -- queue ...`), which shares this harness.
pub const allocator = if (builtin.is_test) std.testing.allocator else std.heap.page_allocator;

pub const tensor_sizes = [_]u64{ 96, 160 };
pub const shard_size_bytes: u64 = 256;

pub fn block_id_of(block: u32) BlockId {
    var id: BlockId = @splat(0);
    std.mem.writeInt(u32, id[0..4], block + 1, .little);
    id[15] = 0xA7;
    return id;
}

pub fn pattern_byte(id: *const BlockId, shard: u32, offset: usize, salt: u8) u8 {
    const block = std.mem.readInt(u32, id[0..4], .little);
    return @truncate(block *% 31 +% shard *% 7 +% offset +% salt);
}

pub fn fill_pattern(target: [*]u8, id: *const BlockId, shard: u32, salt: u8) void {
    for (0..shard_size_bytes) |offset| target[offset] = pattern_byte(id, shard, offset, salt);
}

pub fn matches_pattern(source: []const u8, id: *const BlockId, shard: u32, salt: u8) bool {
    for (source, 0..) |byte, offset| {
        if (byte != pattern_byte(id, shard, offset, salt)) return false;
    }
    return true;
}

/// Simulated other processes (other ranks): liveness by this table, the real process (the
/// queue's own holder) is always alive.
pub const FakeProcess = struct { pid: u32, start_time: u64, alive: bool };
pub var fake_processes: [2]FakeProcess = undefined;

pub fn fake_identity_alive(pid: u32, start_time: u64) bool {
    for (fake_processes) |process| {
        if (process.pid == pid and process.start_time == start_time) return process.alive;
    }
    return true;
}

pub const Harness = struct {
    ctrl: []align(64) u8,
    data: []align(4096) u8,
    base: Buffer,
    own: Buffer,
    others: [2]Buffer,
    queue: *Queue,
    loader: std.Thread,
    /// Keys (block << 8 | shard) the loader fails, and those it reports missing.
    fail_keys: std.AutoHashMap(u64, void),
    missing_keys: std.AutoHashMap(u64, void),
    lock: std.Thread.Mutex = .{},
    /// Fills by the loader (the tiers below), in the order it was asked.
    fills: std.ArrayList(u64),
    loader_delay_ns: u64 = 0,
    salt: u8 = 0,
    null_buffer: bool = false,

    pub const Options = struct {
        regular: u32 = 32,
        reserved: u32 = 0,
        slots_per_segment: u32 = 8,
        local_rank_size: u32 = 1,
        device_id: u32 = 0,
        step_keys: u32 = 1024,
        copy_threads: u32 = 3,
        fill_parts: u32 = 2,
        wait_timeout_ns: u64 = 5 * std.time.ns_per_s,
        prealloc: bool = false,
        rearrange: bool = true,
        shards_per_block: u32 = 4,
        /// The queue runs on a null buffer (a stack without one): every key is BYPASS work.
        null_buffer: bool = false,
    };

    pub fn init(harness: *Harness, options: Options) !void {
        const geometry = buffer_module.Geometry{
            .shard_size_bytes = shard_size_bytes,
            .slot_count_regular = options.regular,
            .slot_count_reserved = options.reserved,
            .bucket_count = 16,
            .slots_per_segment = options.slots_per_segment,
        };
        const ctrl_bytes: usize = @intCast(buffer_module.ctrl_size_bytes(geometry));
        harness.ctrl = try allocator.alignedAlloc(u8, .@"64", ctrl_bytes);
        errdefer allocator.free(harness.ctrl);
        try expectEqual(buffer_module.Status.ok, Buffer.init(@intFromPtr(harness.ctrl.ptr), ctrl_bytes, geometry, 0));
        const segments = geometry.segment_count();
        const segment_bytes = geometry.slots_per_segment * shard_size_bytes;
        harness.data = try allocator.alignedAlloc(u8, .fromByteUnits(4096), @intCast(segments * segment_bytes));
        errdefer allocator.free(harness.data);
        @memset(harness.data, 0xEE);
        buffer_module.debug_identity_alive = fake_identity_alive;
        harness.base = Buffer.open(@intFromPtr(harness.ctrl.ptr)).?;
        harness.own = harness.base;
        harness.own.holder = try harness.base.register();
        for (&fake_processes, 0..) |*process, index| {
            process.* = .{ .pid = 3_900_001 + @as(u32, @intCast(index)), .start_time = 77, .alive = true };
            var view = harness.base;
            view.pid = process.pid;
            view.holder = try harness.base.register_identity(process.pid, process.start_time);
            harness.others[index] = view;
        }
        var bases: [64]usize = undefined;
        for (0..segments) |segment| bases[segment] = @intFromPtr(harness.data.ptr) + segment * segment_bytes;
        var flags: u32 = 0;
        if (options.prealloc) flags |= queue_module.settings_flag_prealloc;
        if (options.rearrange) flags |= queue_module.settings_flag_rearrange;
        const settings = queue_module.Settings{
            .shard_size_bytes = shard_size_bytes,
            .wait_timeout_ns = options.wait_timeout_ns,
            .device_id = options.device_id,
            .local_rank_size = options.local_rank_size,
            .shards_per_block = options.shards_per_block,
            .tensor_count = tensor_sizes.len,
            .step_keys = options.step_keys,
            .copy_threads = options.copy_threads,
            .fill_parts = options.fill_parts,
            .load_queue_depth = 16,
            .dump_queue_depth = 16,
            .flags = flags,
        };
        harness.null_buffer = options.null_buffer;
        const view: ?Buffer = if (options.null_buffer) null else harness.own;
        try expect(Queue.validate_settings(settings, view));
        harness.fail_keys = std.AutoHashMap(u64, void).init(allocator);
        harness.missing_keys = std.AutoHashMap(u64, void).init(allocator);
        harness.fills = .empty;
        harness.lock = .{};
        harness.loader_delay_ns = 0;
        harness.salt = 0;
        const queue_bases = if (options.null_buffer) bases[0..0] else bases[0..segments];
        harness.queue = try Queue.create(allocator, view, settings, &tensor_sizes, queue_bases, null);
        harness.loader = try std.Thread.spawn(.{}, loader_loop, .{harness});
    }

    pub fn deinit(harness: *Harness) void {
        harness.queue.stop_and_join();
        harness.loader.join();
        harness.queue.destroy();
        harness.fail_keys.deinit();
        harness.missing_keys.deinit();
        harness.fills.deinit(allocator);
        allocator.free(harness.data);
        allocator.free(harness.ctrl);
        buffer_module.debug_identity_alive = null;
    }

    pub fn key_code(id: *const BlockId, shard: u32) u64 {
        return @as(u64, std.mem.readInt(u32, id[0..4], .little)) << 8 | shard;
    }

    /// The caller's loaders: fills slots and destinations with the pattern (the tiers below).
    fn loader_loop(harness: *Harness) void {
        var items: [32]queue_module.WorkItem = undefined;
        var batches: u64 = 0;
        while (batches < std.math.maxInt(u64)) : (batches += 1) {
            const taken = harness.queue.next_work(20 * std.time.ns_per_ms, &items) orelse return;
            if (harness.loader_delay_ns > 0 and taken > 0) std.Thread.sleep(harness.loader_delay_ns);
            for (items[0..taken]) |item| harness.serve(item);
        }
    }

    fn serve(harness: *Harness, item: queue_module.WorkItem) void {
        const queue = harness.queue;
        const task = &queue.tasks[item.task];
        assert(task.live and task.generation == item.generation);
        const id = &task.ids[item.entry];
        const shard = task.shards[item.entry];
        const code = key_code(id, shard);
        harness.lock.lock();
        const fails = harness.fail_keys.contains(code);
        const missing = harness.missing_keys.contains(code);
        if (item.kind != .copy_out) harness.fills.append(allocator, code) catch unreachable;
        const salt = harness.salt;
        harness.lock.unlock();
        var state: queue_module.WorkState = if (fails) .failed else if (missing) .missing else .ready;
        switch (item.kind) {
            .fill => if (state == .ready) fill_pattern(@ptrFromInt(queue.slot_address_of(item.slot)), id, shard, salt),
            .bypass => if (state == .ready) {
                var scratch: [shard_size_bytes]u8 = undefined;
                fill_pattern(&scratch, id, shard, salt);
                // A null buffer's prefetch has no destination: it goes into the top tier.
                if (task.addresses != null) scatter(task, item.entry, &scratch);
                // A null buffer's loader says which tier served the key: even blocks "top".
                if (harness.null_buffer and std.mem.readInt(u32, id[0..4], .little) % 2 == 0) state = .hit;
            } else {
                state = .failed;
            },
            .copy_out => {
                const slot: [*]const u8 = @ptrFromInt(queue.slot_address_of(item.slot));
                scatter(task, item.entry, slot[0..shard_size_bytes]);
                state = .ready;
            },
        }
        const report = Queue.Report{
            .token = (@as(u64, item.generation) << 32) | item.task,
            .entry = item.entry,
            .slot = item.slot,
            .step = item.step,
            .kind = item.kind,
            .state = state,
        };
        assert(queue.accept_report(report));
        assert(!queue.accept_report(report)); // a second report of the same item is refused
        queue.work_done(report);
    }

    fn scatter(task: anytype, entry: u32, bytes: []const u8) void {
        var offset: usize = 0;
        for (tensor_sizes, 0..) |size, j| {
            const target: [*]u8 = @ptrFromInt(task.addresses.?[entry * tensor_sizes.len + j]);
            @memcpy(target[0..size], bytes[offset..][0..size]);
            offset += size;
        }
    }
};

/// One task's caller memory: keys, destinations (or sources), results.
pub const Call = struct {
    ids: []BlockId,
    shards: []u32,
    memory: []u8,
    addresses: []u64,
    results: []u8,
    entry_flags: ?[]u8 = null,

    pub fn init(blocks: []const u32, shard: u32) !Call {
        const n = blocks.len;
        var call = Call{
            .ids = try allocator.alloc(BlockId, n),
            .shards = try allocator.alloc(u32, n),
            .memory = try allocator.alloc(u8, n * shard_size_bytes),
            .addresses = try allocator.alloc(u64, n * tensor_sizes.len),
            .results = try allocator.alloc(u8, n),
        };
        @memset(call.memory, 0);
        for (blocks, 0..) |block, i| {
            call.ids[i] = block_id_of(block);
            call.shards[i] = shard;
            var offset: usize = i * shard_size_bytes;
            for (tensor_sizes, 0..) |size, j| {
                call.addresses[i * tensor_sizes.len + j] = @intFromPtr(call.memory.ptr) + offset;
                offset += size;
            }
        }
        return call;
    }

    pub fn with_pattern(call: *Call, salt: u8) void {
        for (call.ids, call.shards, 0..) |*id, shard, i| {
            fill_pattern(call.memory[i * shard_size_bytes ..].ptr, id, shard, salt);
        }
    }

    pub fn deinit(call: *Call) void {
        allocator.free(call.ids);
        allocator.free(call.shards);
        allocator.free(call.memory);
        allocator.free(call.addresses);
        allocator.free(call.results);
        if (call.entry_flags) |flags| allocator.free(flags);
    }

    pub fn submission(call: *Call, kind: queue_module.TaskKind, flags: u32) Queue.Submission {
        return .{
            .kind = kind,
            .flags = flags,
            .ids = call.ids,
            .shards = call.shards,
            .addresses = if (kind == .prefetch) null else call.addresses,
            .entry_flags = call.entry_flags,
            .results = call.results,
            .tag = 42,
        };
    }

    pub fn submit(call: *Call, queue: *Queue, kind: queue_module.TaskKind, flags: u32) !u64 {
        const task = call.submission(kind, flags);
        try expect(queue.validate(task));
        return queue.submit(task, std.time.ns_per_s);
    }

    pub fn run(call: *Call, queue: *Queue, kind: queue_module.TaskKind, flags: u32) !void {
        const token = try call.submit(queue, kind, flags);
        try expectEqual(@as(?bool, true), queue.wait(token, 20 * std.time.ns_per_s));
        try expectEqual(@as(?bool, true), queue.done(token));
    }

    pub fn exact(call: *const Call, index: usize, salt: u8) bool {
        return matches_pattern(call.memory[index * shard_size_bytes ..][0..shard_size_bytes], &call.ids[index], call.shards[index], salt);
    }

    pub fn all_ok(call: *const Call) bool {
        for (call.results) |result| {
            if (result != @intFromEnum(EntryResult.ok)) return false;
        }
        return true;
    }
};

pub fn counter(queue: *Queue, which: queue_module.Counter) u64 {
    return queue.counter_value(which);
}

/// Waits, in 1 ms sleeps and for `wait_ms_max` at most, until `which` reaches `target`: work
/// the queue's own threads do in the background, which a loaded machine may delay. The caller
/// asserts the count afterwards.
pub fn await_counter(queue: *Queue, which: queue_module.Counter, target: u64, wait_ms_max: u32) void {
    var waited_ms: u32 = 0;
    while (counter(queue, which) < target and waited_ms < wait_ms_max) : (waited_ms += 1) {
        std.Thread.sleep(std.time.ns_per_ms);
    }
}

pub fn expect_no_references(harness: *Harness) !void {
    try expectEqual(@as(u32, 0), harness.queue.held_slot_count());
    if (harness.null_buffer) return;
    const mine = buffer_module.holder_bit(harness.own.holder);
    for (harness.base.slots) |*slot| try expectEqual(@as(u64, 0), slot.holders.load(.monotonic) & mine);
}

test "queue: owners are filled by the loader, then every load is a hit, byte-exact" {
    var harness: Harness = undefined;
    try harness.init(.{});
    defer harness.deinit();
    const blocks = [_]u32{ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 };
    var cold = try Call.init(&blocks, 1);
    defer cold.deinit();
    try cold.run(harness.queue, .load, 0);
    try expect(cold.all_ok());
    for (0..blocks.len) |i| try expect(cold.exact(i, 0));
    try expectEqual(@as(u64, 10), counter(harness.queue, .owned));
    try expectEqual(@as(u64, 10), counter(harness.queue, .misses));
    var warm = try Call.init(&blocks, 1);
    defer warm.deinit();
    try warm.run(harness.queue, .load, 0);
    try expect(warm.all_ok());
    for (0..blocks.len) |i| try expect(warm.exact(i, 0));
    try expectEqual(@as(u64, 10), counter(harness.queue, .hits));
    try expectEqual(@as(u64, 20), counter(harness.queue, .loaded_shards));
    try expectEqual(@as(usize, 10), harness.fills.items.len); // each key read from below once
    try expect_no_references(&harness);
}

test "queue: RearrangeIndex order (own stride first, then rotation) reaches the loader" {
    var harness: Harness = undefined;
    try harness.init(.{ .local_rank_size = 4, .device_id = 6, .fill_parts = 1 });
    defer harness.deinit();
    const blocks = [_]u32{ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 };
    var call = try Call.init(&blocks, 0);
    defer call.deinit();
    try call.run(harness.queue, .load, 0);
    try expect(call.all_ok());
    const expected = [_]u32{ 2, 6, 10, 3, 7, 11, 0, 4, 8, 1, 5, 9 };
    for (harness.fills.items, expected) |code, block| try expectEqual(@as(u64, block + 1) << 8, code);
}

test "queue: loader failures and misses fail only their keys; a later load retries them" {
    var harness: Harness = undefined;
    try harness.init(.{});
    defer harness.deinit();
    try harness.fail_keys.put(Harness.key_code(&block_id_of(2), 0), {});
    try harness.missing_keys.put(Harness.key_code(&block_id_of(4), 0), {});
    const blocks = [_]u32{ 0, 1, 2, 3, 4, 5 };
    var call = try Call.init(&blocks, 0);
    defer call.deinit();
    try call.run(harness.queue, .load, 0);
    for (call.results, 0..) |result, i| {
        const expected: EntryResult = if (i == 2 or i == 4) .caller_failed else .ok;
        try expectEqual(@intFromEnum(expected), result);
        if (expected == .ok) try expect(call.exact(i, 0));
    }
    try expectEqual(@as(u64, 2), counter(harness.queue, .failed_shards));
    // Failures are not remembered: once the tier serves them, they load.
    harness.fail_keys.clearRetainingCapacity();
    harness.missing_keys.clearRetainingCapacity();
    var again = try Call.init(&blocks, 0);
    defer again.deinit();
    try again.run(harness.queue, .load, 0);
    try expect(again.all_ok());
    try expect(again.exact(2, 0) and again.exact(4, 0));
    try expect_no_references(&harness);
}

fn commit_later(view: Buffer, slot: u32, state: buffer_module.State, delay_ns: u64, data: usize, id: BlockId, shard: u32) void {
    std.Thread.sleep(delay_ns);
    if (state == .ready) fill_pattern(@ptrFromInt(data), &id, shard, 0);
    var out = [1]buffer_module.CommitResult{.ok};
    view.commit(&.{slot}, &.{@as(u8, @intCast(@intFromEnum(state)))}, &out);
    assert(out[0] == .ok);
    _ = view.release(&.{slot});
}

test "queue: waiters sleep on another rank's load and copy once it commits (Scenario B)" {
    var harness: Harness = undefined;
    try harness.init(.{});
    defer harness.deinit();
    const other = harness.others[0];
    const states = [_]buffer_module.State{ .ready, .failed, .missing };
    const expected = [_]EntryResult{ .ok, .owner_failed, .owner_missing };
    for (states, expected, 0..) |state, want, index| {
        const block: u32 = 40 + @as(u32, @intCast(index));
        var result = [1]buffer_module.GetResult{.hit};
        var slot = [1]u32{0};
        other.get(&.{block_id_of(block)}, &.{0}, .{ .results = &result, .slots = &slot });
        try expectEqual(buffer_module.GetResult.owner, result[0]);
        const address = harness.queue.slot_address_of(slot[0]);
        const committer = try std.Thread.spawn(.{}, commit_later, .{ other, slot[0], state, 50 * std.time.ns_per_ms, address, block_id_of(block), @as(u32, 0) });
        var call = try Call.init(&.{block}, 0);
        defer call.deinit();
        try call.run(harness.queue, .load, 0);
        committer.join();
        try expectEqual(@intFromEnum(want), call.results[0]);
        if (want == .ok) try expect(call.exact(0, 0));
    }
    try expectEqual(@as(u64, 3), counter(harness.queue, .waited));
    try expectEqual(@as(usize, 0), harness.fills.items.len); // nothing was read from below here
    try expect_no_references(&harness);
}

test "queue: a no-wait load misses a key another rank is filling, at once; no-fill alone waits" {
    var harness: Harness = undefined;
    // A wait would outlast the test's bound (`Call.run` waits 20 s).
    try harness.init(.{ .wait_timeout_ns = 600 * std.time.ns_per_s });
    defer harness.deinit();
    var dump = try Call.init(&.{9}, 0);
    defer dump.deinit();
    dump.with_pattern(0);
    try dump.run(harness.queue, .dump, 0);
    try expect(dump.all_ok());
    var result = [1]buffer_module.GetResult{.hit};
    var slot = [1]u32{0};
    harness.others[0].get(&.{block_id_of(8)}, &.{0}, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.owner, result[0]); // filling it, for as long as it likes
    const no_wait = queue_module.task_flag_no_fill | queue_module.task_flag_no_wait;
    var call = try Call.init(&.{ 8, 9 }, 0);
    defer call.deinit();
    try call.run(harness.queue, .load, no_wait);
    try expectEqual(@intFromEnum(EntryResult.missing), call.results[0]);
    try expectEqual(@intFromEnum(EntryResult.ok), call.results[1]);
    try expect(call.exact(1, 0));
    try expectEqual(@as(u64, 0), counter(harness.queue, .waited));
    try expectEqual(@as(u64, 0), counter(harness.queue, .wait_timeouts));
    try expectEqual(@as(usize, 0), harness.fills.items.len);
    // The other rank's fill is untouched: it commits, and the key is a hit for both kinds.
    var out = [1]buffer_module.CommitResult{.ok};
    fill_pattern(@ptrFromInt(harness.queue.slot_address_of(slot[0])), &block_id_of(8), 0, 0);
    harness.others[0].commit(&slot, &.{1}, &out);
    try expectEqual(buffer_module.CommitResult.ok, out[0]);
    _ = harness.others[0].release(&slot);
    var again = try Call.init(&.{ 8, 9 }, 0);
    defer again.deinit();
    try again.run(harness.queue, .load, no_wait);
    try expect(again.all_ok());
    for (0..2) |i| try expect(again.exact(i, 0));
    // No-fill alone (the buffer tier's load) waits for another rank's fill: Missing there.
    harness.others[0].get(&.{block_id_of(7)}, &.{0}, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.owner, result[0]);
    var waiter = try Call.init(&.{7}, 0);
    defer waiter.deinit();
    const claimed_before = counter(harness.queue, .get_keys);
    const token = try waiter.submit(harness.queue, .load, queue_module.task_flag_no_fill);
    // Claimed (a waiter): it then waits for the fill, far past this test's bounds.
    var rounds: u32 = 0;
    while (counter(harness.queue, .get_keys) == claimed_before and rounds < 20_000) : (rounds += 1) std.Thread.sleep(std.time.ns_per_ms);
    try expectEqual(claimed_before + 1, counter(harness.queue, .get_keys));
    std.Thread.sleep(20 * std.time.ns_per_ms);
    try expectEqual(@as(?bool, false), harness.queue.done(token));
    harness.others[0].commit(&slot, &.{3}, &out);
    _ = harness.others[0].release(&slot);
    try expectEqual(@as(?bool, true), harness.queue.wait(token, 20 * std.time.ns_per_s));
    try expectEqual(@intFromEnum(EntryResult.owner_missing), waiter.results[0]);
    // No-wait is a no-fill load's option only.
    var bad = waiter.submission(.load, queue_module.task_flag_no_wait);
    try expect(!harness.queue.validate(bad));
    bad.kind = .prefetch;
    bad.addresses = null;
    bad.flags = queue_module.task_flag_no_fill | queue_module.task_flag_no_wait;
    try expect(!harness.queue.validate(bad));
    try expect_no_references(&harness);
}

test "queue: a waiter whose owner died takes the slot over and fills it" {
    var harness: Harness = undefined;
    try harness.init(.{});
    defer harness.deinit();
    var result = [1]buffer_module.GetResult{.hit};
    var slot = [1]u32{0};
    harness.others[1].get(&.{block_id_of(5)}, &.{2}, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.owner, result[0]);
    fake_processes[1].alive = false; // killed mid-load (kill -9): it never commits
    var call = try Call.init(&.{5}, 2);
    defer call.deinit();
    try call.run(harness.queue, .load, 0);
    try expect(call.all_ok());
    try expect(call.exact(0, 0));
    try expectEqual(@as(u64, 1), counter(harness.queue, .takeovers));
    try expectEqual(@as(usize, 1), harness.fills.items.len);
    try expect_no_references(&harness);
}

test "queue: a waiter that outlives a live owner loads the key from below (bypass)" {
    var harness: Harness = undefined;
    try harness.init(.{ .wait_timeout_ns = 100 * std.time.ns_per_ms });
    defer harness.deinit();
    var result = [1]buffer_module.GetResult{.hit};
    var slot = [1]u32{0};
    harness.others[0].get(&.{block_id_of(8)}, &.{0}, .{ .results = &result, .slots = &slot });
    var call = try Call.init(&.{8}, 0);
    defer call.deinit();
    try call.run(harness.queue, .load, 0);
    try expect(call.all_ok());
    try expect(call.exact(0, 0));
    try expectEqual(@as(u64, 1), counter(harness.queue, .bypassed));
    var out = [1]buffer_module.CommitResult{.ok};
    harness.others[0].commit(&slot, &.{1}, &out);
    _ = harness.others[0].release(&slot);
    try expect_no_references(&harness);
}

test "queue: no-fill loads miss, prefetch brings keys up, Prealloc prewarms the next index" {
    var harness: Harness = undefined;
    try harness.init(.{ .regular = 16, .reserved = 8, .prealloc = true });
    defer harness.deinit();
    var miss = try Call.init(&.{ 1, 2 }, 0);
    defer miss.deinit();
    try miss.run(harness.queue, .load, queue_module.task_flag_no_fill);
    for (miss.results) |code| try expectEqual(@intFromEnum(EntryResult.missing), code);
    try expectEqual(@as(usize, 0), harness.fills.items.len);
    // The idle window after this load prewarms (block, 1) of its 2 blocks; wait for it before
    // the next task, which would otherwise end that window first on a loaded machine (a CI
    // run beside two CPU burners found 3 of 5 below even after the 60 s wait).
    await_counter(harness.queue, .prewarmed, 2, 60_000);
    try expectEqual(@as(u64, 2), counter(harness.queue, .prewarmed));
    var prefetch = try Call.init(&.{ 1, 2, 3 }, 1);
    defer prefetch.deinit();
    try prefetch.run(harness.queue, .prefetch, 0);
    try expect(prefetch.all_ok());
    try expectEqual(@as(u64, 3), counter(harness.queue, .prefetched_shards));
    var present: [3]u8 = undefined;
    try harness.base.lookup(prefetch.ids, prefetch.shards, &present);
    try expectEqualSlices(u8, &.{ 1, 1, 1 }, &present);
    var load = try Call.init(&.{ 1, 2, 3 }, 1);
    defer load.deinit();
    try load.run(harness.queue, .load, queue_module.task_flag_no_fill);
    try expect(load.all_ok());
    for (0..3) |i| try expect(load.exact(i, 0));
    // The idle window after the load prewarmed (block, 2) of its blocks (Scenario E). The
    // prewarm runs on the queue's own threads: on a loaded machine 1 s was not enough (a CI run
    // beside two CPU burners found 3 of 5), so the wait is bounded at 60 s.
    await_counter(harness.queue, .prewarmed, 5, 60_000);
    try expectEqual(@as(u64, 5), counter(harness.queue, .prewarmed)); // (b, 1) after the first load too
    for ([_]u32{ 1, 2, 3 }) |block| {
        const found = (try harness.base.find_locked(&block_id_of(block), 2)).?;
        const slot = &harness.base.slots[found];
        try expectEqual(@as(u32, 0), slot.refcount());
        try expect(slot.flags.load(.monotonic) & buffer_module.slot_flag_preallocated != 0);
    }
    try expect_no_references(&harness);
}

const expectEqualSlices = std.testing.expectEqualSlices;

test "queue: a no-fill load of absent keys in a full buffer misses them and evicts nothing" {
    var harness: Harness = undefined;
    try harness.init(.{ .regular = 4, .step_keys = 8 });
    defer harness.deinit();
    var dump = try Call.init(&.{ 1, 2, 3, 4 }, 0);
    defer dump.deinit();
    dump.with_pattern(5);
    try dump.run(harness.queue, .dump, 0);
    try expect(dump.all_ok());
    try expectEqual(@as(u64, 0), harness.base.occupancy().free); // every slot Ready
    const evictions = harness.base.counter_value(.evictions);
    const occupancy = harness.base.occupancy();
    const missing = @intFromEnum(EntryResult.missing);
    const ok = @intFromEnum(EntryResult.ok);
    const no_fill = queue_module.task_flag_no_fill;
    for ([_]u32{ no_fill, no_fill | queue_module.task_flag_no_wait }) |flags| {
        var load = try Call.init(&.{ 8, 1, 9 }, 0);
        defer load.deinit();
        try load.run(harness.queue, .load, flags);
        try expectEqualSlices(u8, &.{ missing, ok, missing }, load.results);
        try expect(load.exact(1, 5));
        // No slot claimed for the absent keys: no CLOCK victim, nothing for the loader.
        try expectEqual(evictions, harness.base.counter_value(.evictions));
        try std.testing.expectEqualDeep(occupancy, harness.base.occupancy());
        try expect((try harness.base.find_locked(&block_id_of(8), 0)) == null);
        try expectEqual(@as(usize, 0), harness.fills.items.len);
    }
    var present: [4]u8 = undefined;
    try harness.base.lookup(dump.ids, dump.shards, &present);
    try expectEqualSlices(u8, &.{ 1, 1, 1, 1 }, &present);
    try expect_no_references(&harness);
}

test "queue: dumps publish Ready, a re-dump replaces the bytes, a full buffer fails named keys" {
    var harness: Harness = undefined;
    try harness.init(.{ .regular = 4, .step_keys = 8 });
    defer harness.deinit();
    var dump = try Call.init(&.{ 10, 11, 12 }, 3);
    defer dump.deinit();
    dump.with_pattern(5);
    try dump.run(harness.queue, .dump, 0);
    try expect(dump.all_ok());
    var load = try Call.init(&.{ 10, 11, 12 }, 3);
    defer load.deinit();
    try load.run(harness.queue, .load, queue_module.task_flag_no_fill);
    for (0..3) |i| try expect(load.exact(i, 5));
    var redump = try Call.init(&.{10}, 3);
    defer redump.deinit();
    redump.with_pattern(9);
    try redump.run(harness.queue, .dump, 0);
    var reload = try Call.init(&.{10}, 3);
    defer reload.deinit();
    try reload.run(harness.queue, .load, queue_module.task_flag_no_fill);
    try expect(reload.exact(0, 9));
    try expectEqual(@as(u64, 4), counter(harness.queue, .dumped_shards));
    // Four slots, all held by other processes' readers: a dump finds none.
    var held: [4]u32 = undefined;
    for (0..4) |i| {
        var result = [1]buffer_module.GetResult{.hit};
        var slot = [1]u32{0};
        const id = block_id_of(60 + @as(u32, @intCast(i)));
        harness.others[0].get(&.{id}, &.{0}, .{ .results = &result, .slots = &slot });
        var out = [1]buffer_module.CommitResult{.ok};
        if (result[0] == .owner) harness.others[0].commit(&slot, &.{1}, &out);
        held[i] = slot[0];
    }
    var full = try Call.init(&.{70}, 0);
    defer full.deinit();
    full.with_pattern(1);
    try full.run(harness.queue, .dump, 0);
    try expectEqual(@intFromEnum(EntryResult.no_slot), full.results[0]);
    _ = harness.others[0].release(&held);
    try expect_no_references(&harness);
}

test "queue: a dirty dump commits write-back debt; a flusher's claims share the local uses" {
    var harness: Harness = undefined;
    try harness.init(.{ .regular = 8 });
    defer harness.deinit();
    var dump = try Call.init(&.{ 1, 2, 3 }, 0);
    defer dump.deinit();
    dump.with_pattern(0);
    try dump.run(harness.queue, .dump, queue_module.task_flag_dirty);
    try expect(dump.all_ok());
    try expectEqual(@as(u64, 3), harness.base.counter_value(.dirty_slots));
    // The flusher takes the debt through the queue: its references are this process's uses,
    // so a load of the same keys meanwhile sees them held (Ready) and copies them.
    var cursor: u32 = 0;
    var slots: [4]u32 = undefined;
    var ids: [4]BlockId = undefined;
    var shards: [4]u32 = undefined;
    const taken = harness.queue.take_dirty(&cursor, .{ .slots = &slots, .block_ids = &ids, .shard_indices = &shards });
    try expectEqual(@as(u32, 3), taken);
    try expectEqual(@as(u32, 3), harness.queue.held_slot_count());
    var load = try Call.init(&.{ 1, 2, 3 }, 0);
    defer load.deinit();
    try load.run(harness.queue, .load, queue_module.task_flag_no_fill);
    try expect(load.all_ok());
    for (0..3) |i| try expect(load.exact(i, 0));
    try expectEqual(@as(u32, 3), harness.queue.held_slot_count()); // the flusher's remain
    // Dirty slots are never victims: eight more keys take the five clean slots (evicting
    // each other), never the three dirty ones.
    var more = try Call.init(&.{ 10, 11, 12, 13, 14, 15, 16, 17 }, 0);
    defer more.deinit();
    more.with_pattern(0);
    try more.run(harness.queue, .dump, 0);
    try expect(more.all_ok());
    for (ids[0..taken], shards[0..taken]) |*id, shard| {
        try expect((try harness.base.find_locked(id, shard)) != null); // still resident
    }
    try expectEqual(@as(u32, 3), harness.own.clean(slots[0..taken], &.{ 1, 1, 1 }));
    var twice = [2]u32{ slots[0], slots[0] };
    try expect(!harness.queue.release_taken(&twice)); // more uses than this process holds
    try expect(harness.queue.release_taken(slots[0..taken]));
    try expectEqual(@as(u64, 0), harness.base.counter_value(.dirty_slots));
    try expect_no_references(&harness);
}

test "queue: a pin holds Ready slots through eviction until unpinned; absent keys take nothing" {
    var harness: Harness = undefined;
    try harness.init(.{ .regular = 4, .step_keys = 8 });
    defer harness.deinit();
    var dump = try Call.init(&.{ 1, 2 }, 0);
    defer dump.deinit();
    dump.with_pattern(3);
    try dump.run(harness.queue, .dump, 0);
    try expect(dump.all_ok());
    const ids = [_]BlockId{ block_id_of(1), block_id_of(2), block_id_of(9) };
    var slots: [3]u32 = undefined;
    try expectEqual(@as(u32, 2), harness.queue.pin(&ids, &.{ 0, 0, 0 }, &slots));
    try expectEqual(buffer_module.slot_none, slots[2]); // absent: no slot allocated for it
    try expect((try harness.base.find_locked(&ids[2], 0)) == null);
    try expectEqual(@as(u32, 2), harness.queue.held_slot_count());
    // Pressure: six other keys go through the two unpinned slots, evicting each other; the
    // pins count against no claim budget (no wait), and the pinned shards stay, byte-exact.
    for ([_]u32{ 10, 11, 12, 13, 14, 15 }) |block| {
        var more = try Call.init(&.{block}, 0);
        defer more.deinit();
        more.with_pattern(0);
        try more.run(harness.queue, .dump, 0);
        try expect(more.all_ok());
    }
    try expectEqual(@as(u64, 0), counter(harness.queue, .wait_timeouts));
    var load = try Call.init(&.{ 1, 2 }, 0);
    defer load.deinit();
    try load.run(harness.queue, .load, queue_module.task_flag_no_fill);
    try expect(load.all_ok());
    for (0..2) |i| try expect(load.exact(i, 3));
    var twice = [2]u32{ slots[0], slots[0] };
    try expect(!harness.queue.unpin(&twice)); // more uses than this process holds
    var three = [3]u32{ slots[0], slots[1], slots[1] };
    try expect(!harness.queue.unpin(&three)); // more than are pinned
    try expect(harness.queue.unpin(slots[0..2]));
    try expectEqual(@as(u32, 0), harness.queue.pinned);
    // Unpinned: the next keys may evict them.
    for ([_]u32{ 20, 21, 22, 23 }) |block| {
        var more = try Call.init(&.{block}, 0);
        defer more.deinit();
        more.with_pattern(0);
        try more.run(harness.queue, .dump, 0);
    }
    try expect((try harness.base.find_locked(&ids[0], 0)) == null);
    try expect((try harness.base.find_locked(&ids[1], 0)) == null);
    try expect_no_references(&harness);
}

test "queue: caller-copy entries are handed out with their Ready slot" {
    var harness: Harness = undefined;
    try harness.init(.{});
    defer harness.deinit();
    var call = try Call.init(&.{ 1, 2, 3 }, 0);
    defer call.deinit();
    call.entry_flags = try allocator.alloc(u8, 3);
    @memcpy(call.entry_flags.?, &[_]u8{ 0, queue_module.entry_flag_caller_copy, 0 });
    try call.run(harness.queue, .load, 0);
    try expect(call.all_ok());
    for (0..3) |i| try expect(call.exact(i, 0));
    try expect_no_references(&harness);
}

test "queue: many tasks in flight complete; drain waits for them; submit after drain is refused" {
    var harness: Harness = undefined;
    try harness.init(.{ .regular = 64 });
    defer harness.deinit();
    harness.loader_delay_ns = 2 * std.time.ns_per_ms;
    var calls: [6]Call = undefined;
    var tokens: [6]u64 = undefined;
    for (&calls, &tokens, 0..) |*call, *token, t| {
        const first: u32 = @intCast(t * 5);
        call.* = try Call.init(&.{ first, first + 1, first + 2, first + 3, first + 4 }, 0);
        token.* = try call.submit(harness.queue, .load, 0);
    }
    try expectEqual(@as(?bool, false), harness.queue.done(tokens[5]));
    try expect(harness.queue.drain(20 * std.time.ns_per_s));
    for (&calls, tokens) |*call, token| {
        try expectEqual(@as(?bool, true), harness.queue.done(token));
        try expect(call.all_ok());
        for (0..5) |i| try expect(call.exact(i, 0));
        call.deinit();
    }
    var late = try Call.init(&.{99}, 0);
    defer late.deinit();
    try std.testing.expectError(error.Closed, late.submit(harness.queue, .load, 0));
    try expect_no_references(&harness);
}

test "copy_bytes: every length and misalignment lands exactly, non-temporal or not" {
    var source: [3 * 4096 + 200]u8 = undefined;
    for (&source, 0..) |*byte, index| byte.* = @truncate(index *% 131 +% 7);
    var target: [3 * 4096 + 300]u8 = undefined;
    const lengths = [_]usize{ 0, 1, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 100 };
    for (lengths) |length| {
        for ([_]usize{ 0, 1, 16, 33, 63 }) |target_offset| {
            for ([_]usize{ 0, 5, 64 }) |source_offset| {
                @memset(&target, 0xEE);
                queue_module.copy_bytes(@intFromPtr(&target) + target_offset, @intFromPtr(&source) + source_offset, length);
                queue_module.store_fence();
                try std.testing.expectEqualSlices(u8, source[source_offset..][0..length], target[target_offset..][0..length]);
                for (target[0..target_offset]) |byte| try expectEqual(@as(u8, 0xEE), byte);
                for (target[target_offset + length ..]) |byte| try expectEqual(@as(u8, 0xEE), byte);
            }
        }
    }
}

test "queue: a null buffer bypasses every key; the loader's report counts hits and misses" {
    var harness: Harness = undefined;
    try harness.init(.{ .null_buffer = true, .local_rank_size = 2, .device_id = 1, .fill_parts = 3 });
    defer harness.deinit();
    const queue = harness.queue;
    try expect(queue.buffer == null);
    // Blocks 0..5 (ids 1..6): even ids are served by the top tier (hits), odd ones from below.
    var call = try Call.init(&.{ 0, 1, 2, 3, 4, 5 }, 2);
    defer call.deinit();
    try call.run(queue, .load, 0);
    try expect(call.all_ok());
    for (0..6) |i| try expect(call.exact(i, 0));
    try expectEqual(@as(u64, 6), counter(queue, .bypassed));
    try expectEqual(@as(u64, 3), counter(queue, .hits));
    try expectEqual(@as(u64, 3), counter(queue, .misses));
    try expectEqual(@as(u64, 6), counter(queue, .loaded_shards));
    try expectEqual(@as(u64, 0), counter(queue, .owned));
    // RearrangeIndex: rank 1 of 2 walks its own stride first.
    harness.lock.lock();
    const fills = harness.fills.items;
    try expectEqual(@as(usize, 6), fills.len);
    harness.lock.unlock();
    // A failing key fails alone; a prefetch goes to the loaders (into the top tier).
    harness.lock.lock();
    try harness.fail_keys.put(Harness.key_code(&block_id_of(4), 2), {});
    harness.lock.unlock();
    var again = try Call.init(&.{ 3, 4 }, 2);
    defer again.deinit();
    try again.run(queue, .load, 0);
    try expectEqual(@as(u8, @intFromEnum(EntryResult.ok)), again.results[0]);
    try expectEqual(@as(u8, @intFromEnum(EntryResult.caller_failed)), again.results[1]);
    try expectEqual(@as(u64, 1), counter(queue, .failed_shards));
    var prefetch = try Call.init(&.{ 7, 8 }, 1);
    defer prefetch.deinit();
    try prefetch.run(queue, .prefetch, 0);
    try expect(prefetch.all_ok());
    // Block 7 (id 8) is "in the top tier": a hit, nothing brought up; block 8 (id 9) is.
    try expectEqual(@as(u64, 1), counter(queue, .prefetched_shards));
    // No slots: no dumps, no no-fill loads.
    var dump = try Call.init(&.{9}, 0);
    defer dump.deinit();
    const refused = Queue.Submission{ .kind = .dump, .flags = 0, .ids = dump.ids, .shards = dump.shards, .addresses = dump.addresses, .entry_flags = null, .results = dump.results, .tag = 1 };
    try expect(!queue.validate(refused));
    var no_fill = refused;
    no_fill.kind = .load;
    no_fill.flags = queue_module.task_flag_no_fill;
    try expect(!queue.validate(no_fill));
    try expectEqual(@as(u32, 0), queue.held_slot_count());
}
