//! Seeded model-based fuzzer for the CacheBuffer: random Get/Commit/Wait/Release/Touch/Prealloc/
//! Remove/Lookup sequences against a simple reference model (a map key -> state plus the list
//! of references held), checking every outcome and the structural invariants after each step.
//! Fixed seeds and a bounded number of steps keep `zig build test` deterministic.
const std = @import("std");
const buffer_module = @import("buffer.zig");

const Buffer = buffer_module.Buffer;
const BlockId = buffer_module.BlockId;
const State = buffer_module.State;
const assert = std.debug.assert;
const expect = std.testing.expect;
const expectEqual = std.testing.expectEqual;

const block_count = 5;
const shards_per_block = 3;
const key_count = block_count * shards_per_block;
const steps_per_seed = 3000;
const refs_max = 64;
/// Simulated processes sharing the buffer; each is one holder with its own (fake) identity.
const process_count = 3;
/// Geometry below has at most 10 regular + 4 reserved slots.
const slot_scan_max = 16;

const Role = enum { owner, waiter, hit };

const Ref = struct {
    slot: u32,
    /// The key the slot holds, or null once it was detached (failed or force-removed).
    key: ?u32,
    role: Role,
    /// Index of the simulated process holding it.
    process: u32,
};

const KeyModel = struct {
    present: bool = false,
    ready: bool = false,
    slot: u32 = 0,
    /// The process that owns the idle slot (holds its reference without having committed).
    owner: ?u32 = null,
};

/// The simulated processes: liveness is decided by `fuzz_identity_alive` over this table, so a
/// "kill" is flipping `alive`, and a restart reuses the pid with another start time.
const FakeProcess = struct { pid: u32, start_time: u64, alive: bool };
var fake_processes: [process_count]FakeProcess = undefined;

fn fuzz_identity_alive(pid: u32, start_time: u64) bool {
    for (fake_processes) |process| {
        if (process.pid == pid and process.start_time == start_time) return process.alive;
    }
    return false;
}

const Model = struct {
    keys: [key_count]KeyModel = @splat(.{}),
    refs: [refs_max]Ref = undefined,
    ref_count: usize = 0,

    fn refs_on_key(model: *const Model, key: u32) u32 {
        var total: u32 = 0;
        for (model.refs[0..model.ref_count]) |ref| total += @intFromBool(ref.key == key);
        return total;
    }

    fn holds_key(model: *const Model, process: u32, key: u32) bool {
        for (model.refs[0..model.ref_count]) |ref| {
            if (ref.process == process and ref.key == key) return true;
        }
        return false;
    }

    fn add_ref(model: *Model, ref: Ref) void {
        assert(model.ref_count < refs_max);
        model.refs[model.ref_count] = ref;
        model.ref_count += 1;
    }

    fn drop_ref(model: *Model, index: usize) Ref {
        assert(index < model.ref_count);
        const ref = model.refs[index];
        model.ref_count -= 1;
        model.refs[index] = model.refs[model.ref_count];
        return ref;
    }

    /// Forget a key whose slot left the chain; references still held become detached.
    fn detach_key(model: *Model, key: u32) void {
        for (model.refs[0..model.ref_count]) |*ref| {
            if (ref.key == key) ref.key = null;
        }
        model.keys[key] = .{};
    }

    /// A killed process: every reference it held is gone, its ownerships end.
    fn kill(model: *Model, process: u32) u64 {
        var dropped: u64 = 0;
        var index: usize = 0;
        while (index < model.ref_count) {
            if (model.refs[index].process == process) {
                _ = model.drop_ref(index);
                dropped += 1;
            } else {
                index += 1;
            }
        }
        for (&model.keys) |*key_model| {
            if (key_model.owner == process) key_model.owner = null;
        }
        return dropped;
    }
};

fn block_id_of(block: u32) BlockId {
    var id: BlockId = @splat(0);
    id[0] = @intCast(block + 1);
    id[15] = 0xB0;
    return id;
}

fn key_block(key: u32) u32 {
    return key / shards_per_block;
}

fn key_shard(key: u32) u32 {
    return key % shards_per_block;
}

fn check_invariants(buffer: Buffer, views: []const Buffer, model: *const Model) !void {
    // Every linked slot is on the chain of the bucket it names, keys are unique, and the
    // refcounts equal the references the model holds.
    var seen: [slot_scan_max]bool = @splat(false);
    assert(buffer.slots.len <= seen.len);
    for (buffer.buckets, 0..) |bucket, bucket_index| {
        var current = bucket.head;
        var steps: usize = 0;
        while (current != buffer_module.slot_none) : (steps += 1) {
            try expect(steps < buffer.slots.len);
            try expectEqual(@as(u32, @intCast(bucket_index)), buffer.slots[current].bucket.load(.monotonic));
            try expect(!seen[current]);
            seen[current] = true;
            current = buffer.slots[current].next;
        }
    }
    for (buffer.slots, 0..) |*slot, index| {
        var expected_refs: u32 = 0;
        var expected_holders: u64 = 0;
        for (model.refs[0..model.ref_count]) |ref| {
            if (ref.slot != index) continue;
            expected_refs += 1;
            expected_holders |= buffer_module.holder_bit(views[ref.process].holder);
        }
        try expectEqual(expected_refs, slot.refcount());
        try expectEqual(expected_holders, slot.holders.load(.monotonic));
        const bucket = slot.bucket.load(.monotonic);
        if (bucket == buffer_module.bucket_free) try expectEqual(@as(u32, 0), expected_refs);
        if (bucket < buffer.buckets.len) try expect(seen[index]);
    }
    for (model.keys, 0..) |key_model, key| {
        const id = block_id_of(key_block(@intCast(key)));
        const found = try buffer.find_locked(&id, key_shard(@intCast(key)));
        if (key_model.ready) {
            try expectEqual(@as(?u32, key_model.slot), found);
            try expectEqual(@intFromEnum(State.ready), buffer.slots[key_model.slot].state.load(.monotonic));
        }
        if (!key_model.present) try expectEqual(@as(?u32, null), found);
    }
}

/// Idle keys nobody references may be recycled silently (their slot had no data); sync them.
fn reconcile(buffer: Buffer, model: *Model) !void {
    for (&model.keys, 0..) |*key_model, key| {
        if (!key_model.present or key_model.ready) continue;
        if (model.refs_on_key(@intCast(key)) > 0) continue;
        const id = block_id_of(key_block(@intCast(key)));
        const found = try buffer.find_locked(&id, key_shard(@intCast(key)));
        if (found == null) key_model.* = .{};
    }
}

fn all_in_use(buffer: Buffer, first: usize, end: usize) bool {
    for (buffer.slots[first..end]) |*slot| {
        if (slot.refcount() != 0) continue;
        return false;
    }
    return true;
}

/// Prealloc may only fail when no reserved slot is both unreferenced and without data.
fn no_idle_unused(buffer: Buffer, first: usize, end: usize) bool {
    for (buffer.slots[first..end]) |*slot| {
        const idle = slot.state.load(.monotonic) != @intFromEnum(State.ready);
        const linked_or_free = slot.bucket.load(.monotonic) != buffer_module.bucket_detached;
        if (slot.refcount() == 0 and idle and linked_or_free) return false;
    }
    return true;
}

fn register_process(buffer: Buffer, process: u32) !Buffer {
    const fake = fake_processes[process];
    var view = buffer;
    view.pid = fake.pid;
    view.holder = try buffer.register_identity(fake.pid, fake.start_time);
    return view;
}

fn run_seed(seed: u64) !void {
    var prng = std.Random.DefaultPrng.init(seed);
    const random = prng.random();
    const geometry = buffer_module.Geometry{
        .shard_size_bytes = 64,
        .slot_count_regular = random.intRangeAtMost(u32, 1, 10),
        .slot_count_reserved = random.intRangeAtMost(u32, 0, 4),
        .bucket_count = random.intRangeAtMost(u32, 1, 8),
        .slots_per_segment = random.intRangeAtMost(u32, 1, 5),
    };
    const size_bytes: usize = @intCast(buffer_module.ctrl_size_bytes(geometry));
    const memory = try std.testing.allocator.alignedAlloc(u8, .@"64", size_bytes);
    defer std.testing.allocator.free(memory);
    try expectEqual(buffer_module.Status.ok, Buffer.init(@intFromPtr(memory.ptr), size_bytes, geometry, 0));
    const base = Buffer.open(@intFromPtr(memory.ptr)).?;
    buffer_module.debug_identity_alive = fuzz_identity_alive;
    defer buffer_module.debug_identity_alive = null;
    var views: [process_count]Buffer = undefined;
    for (&fake_processes, 0..) |*process, index| {
        process.* = .{ .pid = 4_000_001 + @as(u32, @intCast(index)), .start_time = 1000, .alive = true };
    }
    for (&views, 0..) |*view, index| view.* = try register_process(base, @intCast(index));
    var model = Model{};

    var step: u32 = 0;
    while (step < steps_per_seed) : (step += 1) {
        const key: u32 = random.uintLessThan(u32, key_count);
        const id = block_id_of(key_block(key));
        const shard = key_shard(key);
        const process = random.uintLessThan(u32, process_count);
        const buffer = views[process];
        switch (random.uintLessThan(u8, 10)) {
            0, 1 => if (model.ref_count < refs_max) {
                var result: [1]buffer_module.GetResult = undefined;
                var slot: [1]u32 = undefined;
                const before = model.keys[key];
                const refs_before = model.refs_on_key(key);
                buffer.get(&.{id}, &.{shard}, .{ .results = &result, .slots = &slot });
                if (before.present and model.holds_key(process, key)) {
                    // One reference per holder: a repeated Get takes nothing.
                    try expectEqual(buffer_module.GetResult.held, result[0]);
                    try expectEqual(before.slot, slot[0]);
                } else if (before.ready) {
                    try expectEqual(buffer_module.GetResult.hit, result[0]);
                    try expectEqual(before.slot, slot[0]);
                    model.add_ref(.{ .slot = slot[0], .key = key, .role = .hit, .process = process });
                } else if (before.present and refs_before > 0) {
                    try expectEqual(buffer_module.GetResult.waiter, result[0]);
                    model.add_ref(.{ .slot = slot[0], .key = key, .role = .waiter, .process = process });
                } else if (result[0] == .no_slot) {
                    try expect(!before.present);
                    try expect(all_in_use(buffer, 0, buffer.slots.len));
                } else {
                    try expectEqual(buffer_module.GetResult.owner, result[0]);
                    if (before.present) try expectEqual(before.slot, slot[0]);
                    for (&model.keys, 0..) |*victim, victim_key| {
                        if (victim_key == key or !victim.present or victim.slot != slot[0]) continue;
                        // The key that held the slot was evicted (Ready) or recycled (idle):
                        // either way nobody referenced it.
                        try expectEqual(@as(u32, 0), model.refs_on_key(@intCast(victim_key)));
                        victim.* = .{};
                    }
                    model.keys[key] = .{ .present = true, .slot = slot[0], .owner = process };
                    model.add_ref(.{ .slot = slot[0], .key = key, .role = .owner, .process = process });
                }
            },
            2 => if (model.ref_count > 0) { // commit an active owner's slot
                const index = random.uintLessThan(usize, model.ref_count);
                const ref = model.refs[index];
                if (ref.role == .owner and ref.key != null and model.keys[ref.key.?].owner == ref.process) {
                    const state = random.enumValue(State);
                    const ready = state == .ready or state == .idle; // idle: commit Ready
                    var out: [1]buffer_module.CommitResult = undefined;
                    const code: u8 = @intCast(@intFromEnum(if (ready) State.ready else state));
                    views[ref.process].commit(&.{ref.slot}, &.{code}, &out);
                    try expectEqual(buffer_module.CommitResult.ok, out[0]);
                    model.refs[index].role = .hit;
                    if (ready) {
                        model.keys[ref.key.?].ready = true;
                        model.keys[ref.key.?].owner = null;
                    } else {
                        model.detach_key(ref.key.?);
                    }
                }
            },
            3 => if (model.ref_count > 0) { // wait (timeout 0) on a waiter
                const index = random.uintLessThan(usize, model.ref_count);
                const ref = model.refs[index];
                if (ref.role == .waiter and ref.key != null) {
                    var out: [1]buffer_module.WaitResult = undefined;
                    views[ref.process].wait(&.{ref.slot}, 0, &out);
                    const key_model = model.keys[ref.key.?];
                    if (key_model.ready) {
                        try expectEqual(buffer_module.WaitResult.ready, out[0]);
                    } else if (key_model.owner != null) {
                        try expectEqual(buffer_module.WaitResult.idle, out[0]);
                    } else {
                        try expectEqual(buffer_module.WaitResult.takeover, out[0]);
                        model.refs[index].role = .owner;
                        model.keys[ref.key.?].owner = ref.process;
                    }
                }
            },
            4 => if (model.ref_count > 0) {
                const index = random.uintLessThan(usize, model.ref_count);
                const ref = model.drop_ref(index);
                try expectEqual(@as(u32, 1), views[ref.process].release(&.{ref.slot}));
                // The owner releasing without committing gives the slot up: waiters take over.
                if (ref.key) |released_key| {
                    const key_model = &model.keys[released_key];
                    if (!key_model.ready and key_model.owner == ref.process) key_model.owner = null;
                }
            },
            5 => {
                var expected: u64 = 0;
                for (0..shards_per_block) |s| {
                    expected += @intFromBool(model.keys[key_block(key) * shards_per_block + s].ready);
                }
                try expectEqual(expected, try buffer.touch(&.{id}));
            },
            6 => {
                var out: [1]buffer_module.PreallocResult = undefined;
                const before = model.keys[key];
                buffer.prealloc(&.{id}, &.{shard}, &out);
                if (before.present) {
                    try expectEqual(buffer_module.PreallocResult.exists, out[0]);
                } else if (out[0] == .no_slot) {
                    try expect(buffer.clock.fresh_regular.load(.monotonic) == geometry.slot_count_regular);
                    try expect(no_idle_unused(buffer, geometry.slot_count_regular, buffer.slots.len));
                } else {
                    try expectEqual(buffer_module.PreallocResult.allocated, out[0]);
                    const slot = (try buffer.find_locked(&id, shard)).?;
                    model.keys[key] = .{ .present = true, .slot = slot };
                }
            },
            7 => {
                const force = random.boolean();
                const whole_block = random.boolean();
                var expected: u64 = 0;
                for (0..key_count) |other_index| {
                    const other: u32 = @intCast(other_index);
                    const selected = if (whole_block) key_block(other) == key_block(key) else other == key;
                    if (!selected or !model.keys[other].present) continue;
                    if (model.refs_on_key(other) > 0 and !force) continue;
                    expected += @intFromBool(model.keys[other].ready);
                    model.detach_key(other);
                }
                const removed = if (whole_block)
                    try buffer.remove(&.{id}, null, force)
                else
                    try buffer.remove(&.{id}, &.{shard}, force);
                try expectEqual(expected, removed);
            },
            8 => {
                var out: [1]u8 = undefined;
                try buffer.lookup(&.{id}, &.{shard}, &out);
                try expectEqual(@intFromBool(model.keys[key].ready), out[0]);
                var block_out: [1]u8 = undefined;
                try buffer.lookup_blocks(&.{id}, shards_per_block, &block_out);
                var all_ready = true;
                for (0..shards_per_block) |s| {
                    all_ready = all_ready and model.keys[key_block(key) * shards_per_block + s].ready;
                }
                try expectEqual(@intFromBool(all_ready), block_out[0]);
            },
            9 => if (random.uintLessThan(u8, 4) == 0) {
                // SIGKILL the process (any instruction boundary between operations), then a
                // survivor sweeps: exactly the dead process's references are dropped, and the
                // restarted process (same pid, new start time: a reused pid) is a new holder.
                const expected_refs = model.kill(process);
                fake_processes[process].alive = false;
                const survivor = views[(process + 1) % process_count];
                const report = try survivor.reclaim_dead();
                try expectEqual(expected_refs, report.refs);
                try expectEqual(@as(u32, 1), report.holders);
                fake_processes[process] = .{
                    .pid = fake_processes[process].pid,
                    .start_time = fake_processes[process].start_time + 1,
                    .alive = true,
                };
                views[process] = try register_process(base, process);
            },
            else => unreachable,
        }
        try reconcile(views[0], &model);
        try check_invariants(views[0], &views, &model);
    }
    // Drain: releasing everything leaves no reference behind.
    while (model.ref_count > 0) {
        const ref = model.drop_ref(model.ref_count - 1);
        try expectEqual(@as(u32, 1), views[ref.process].release(&.{ref.slot}));
    }
    for (views[0].slots) |*slot| try expectEqual(@as(u32, 0), slot.refcount());
}

test "buffer fuzz: model-based, fixed seeds" {
    const seeds = [_]u64{ 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233 };
    for (seeds) |seed| {
        run_seed(seed) catch |err| {
            std.debug.print("buffer fuzz failed with seed {d}\n", .{seed});
            return err;
        };
    }
}

var full_table_alive: [65]bool = @splat(true);

fn full_table_identity_alive(pid: u32, start_time: u64) bool {
    _ = start_time;
    return full_table_alive[pid - 5_000_000];
}

test "holder table: 64 live holders fill it; a dead one is reclaimed to make room" {
    const geometry = buffer_module.Geometry{
        .shard_size_bytes = 64,
        .slot_count_regular = 4,
        .slot_count_reserved = 0,
        .bucket_count = 4,
        .slots_per_segment = 4,
    };
    const size_bytes: usize = @intCast(buffer_module.ctrl_size_bytes(geometry));
    const memory = try std.testing.allocator.alignedAlloc(u8, .@"64", size_bytes);
    defer std.testing.allocator.free(memory);
    try expectEqual(buffer_module.Status.ok, Buffer.init(@intFromPtr(memory.ptr), size_bytes, geometry, 0));
    const base = Buffer.open(@intFromPtr(memory.ptr)).?;
    buffer_module.debug_identity_alive = full_table_identity_alive;
    defer buffer_module.debug_identity_alive = null;
    for (0..64) |index| {
        const holder = try base.register_identity(5_000_000 + @as(u32, @intCast(index)), 1);
        try expectEqual(@as(u32, @intCast(index)), holder);
    }
    // Registering again is idempotent; a 65th process finds no room.
    try expectEqual(@as(u32, 7), try base.register_identity(5_000_007, 1));
    try std.testing.expectError(error.HoldersFull, base.register_identity(5_000_064, 1));
    // Holder 9 takes a reference, then dies: the next registration sweeps it and reuses 9.
    var view = base;
    view.pid = 5_000_009;
    view.holder = 9;
    var result: [1]buffer_module.GetResult = undefined;
    var slot: [1]u32 = undefined;
    view.get(&.{block_id_of(0)}, &.{0}, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.owner, result[0]);
    full_table_alive[9] = false;
    try expectEqual(@as(u32, 9), try base.register_identity(5_000_064, 1));
    try expectEqual(@as(u32, 0), base.slots[slot[0]].refcount());
    try expectEqual(@as(u32, 0), base.slots[slot[0]].owner.load(.monotonic));
    try expectEqual(@as(u64, 0), base.holder_table.dead_mask.load(.monotonic));
    try expectEqual(@as(u64, 1), base.counter_value(.refs_reclaimed));
}

var reuse_alive_start: u64 = 1;

fn reuse_identity_alive(pid: u32, start_time: u64) bool {
    return pid == 6_000_000 and start_time == reuse_alive_start;
}

test "holder table: a reused pid is a new holder; the lock word's pid is judged by both" {
    const geometry = buffer_module.Geometry{
        .shard_size_bytes = 64,
        .slot_count_regular = 4,
        .slot_count_reserved = 0,
        .bucket_count = 4,
        .slots_per_segment = 4,
    };
    const size_bytes: usize = @intCast(buffer_module.ctrl_size_bytes(geometry));
    const memory = try std.testing.allocator.alignedAlloc(u8, .@"64", size_bytes);
    defer std.testing.allocator.free(memory);
    try expectEqual(buffer_module.Status.ok, Buffer.init(@intFromPtr(memory.ptr), size_bytes, geometry, 0));
    const base = Buffer.open(@intFromPtr(memory.ptr)).?;
    buffer_module.debug_identity_alive = reuse_identity_alive;
    defer buffer_module.debug_identity_alive = null;
    reuse_alive_start = 1;
    const first = try base.register_identity(6_000_000, 1);
    try expect(base.lock_holder_alive(6_000_000));
    // The process dies and its pid is reused by a new process (start time 2).
    reuse_alive_start = 2;
    const second = try base.register_identity(6_000_000, 2);
    try expect(second != first);
    try expectEqual(buffer_module.HolderState.dead, base.holder_table.entries[first].state());
    try expect(base.lock_holder_alive(6_000_000)); // the new process holds the pid
    reuse_alive_start = 3; // the new one dies too
    try expect(!base.lock_holder_alive(6_000_000));
    const report = try base.reclaim_dead();
    try expectEqual(@as(u32, 2), report.holders);
}
