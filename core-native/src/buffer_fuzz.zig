//! Seeded model-based fuzzer for the CacheBuffer control plane (`buffer.zig`).
//!
//! Random batches of Get (claims, and lookups that allocate nothing)/Commit/Wait/Release/Touch/
//! Prealloc/Remove/Lookup/ListReady/TakeDirty/Clean/MarkClosing/ReclaimDead run against the
//! real buffer and against `Model`, a plain reference of what the buffer promises: per-slot
//! state arrays, the chains as a key -> slot map, the CLOCK (fresh high-water marks, cursors
//! and accessed bits per pool: regular, then reserved), the holder table and every counter.
//! After every step the whole state is compared field by field, and every result code and
//! slot index, so the model predicts exactly which slot every Get and Prealloc takes and what
//! every lazy recovery does.
//!
//! Simulated processes share one buffer, each with a fake identity (pid + start time) judged
//! alive or dead by `identity_alive` (the `debug_identity_alive` hook). A kill flips the
//! identity dead and nothing else: owners die before commit, waiters and hit readers die
//! holding references, flushers die holding claims, some die holding a bucket lock. Nobody
//! sweeps right away; the model predicts who meets the dead references next (a Get on the
//! slot, an eviction scan of a full buffer, a wait's liveness check and takeover, take_dirty,
//! remove, a restarted process reusing the pid, a full holder table, an eager `reclaim_dead`)
//! and what each of them drops, and which liveness checks mark the dead (those, the lock
//! recovery, `mark_closing`).
//!
//! Determinism: the full-buffer holder scan is rate-limited by monotonic time, so
//! `holder_table.last_scan_ns` is reset to 0 before every operation and every full-buffer miss
//! scans; waits use timeout 0 (the owner's liveness is checked at once). Each run is a sequence
//! of epochs of `epoch_steps` steps, each a fresh buffer with its own random geometry and
//! operation mix (swarm testing), all drawn from the seed: `run(seed, steps)` is reproducible,
//! and `zig build fuzz -- --seed N --steps M` (`fuzz_main.zig`) is the long form.
const std = @import("std");
const buffer_module = @import("buffer.zig");
const constants = @import("constants.zig");

const Buffer = buffer_module.Buffer;
const BlockId = buffer_module.BlockId;
const State = buffer_module.State;
const Counter = buffer_module.Counter;
const GetResult = buffer_module.GetResult;
const GetMode = buffer_module.GetMode;
const WaitResult = buffer_module.WaitResult;
const CommitResult = buffer_module.CommitResult;
const PreallocResult = buffer_module.PreallocResult;
const HolderState = buffer_module.HolderState;
const assert = std.debug.assert;
const expect = std.testing.expect;
const expectEqual = std.testing.expectEqual;
const slot_none = buffer_module.slot_none;

const block_count_max = 6;
const shards_per_block_max = 4;
const key_count_max = block_count_max * shards_per_block_max;
const slot_count_regular_max = 10;
const slot_count_reserved_max = 4;
const slot_count_max = slot_count_regular_max + slot_count_reserved_max;
const bucket_count_max = 8;
const slots_per_segment_max = 5;
/// Simulated processes sharing the buffer.
const process_count_max = 4;
/// Keys (or blocks, or slots) per batched call.
const batch_max = 3;
const holders_max = constants.buffer_holders_max;
const counter_count = buffer_module.counter_count;
/// Steps per epoch (one buffer, one geometry, one operation mix).
pub const epoch_steps: u64 = 2500;
/// Fake pids start above Linux's PID_MAX_LIMIT (4194304), so no real process has one: a check
/// by pid alone (`pid_alive`) of a fake pid finds nobody.
const fake_pid_first: u32 = 600_000_000;

const geometry_max = buffer_module.Geometry{
    .shard_size_bytes = 64,
    .slot_count_regular = slot_count_regular_max,
    .slot_count_reserved = slot_count_reserved_max,
    .bucket_count = bucket_count_max,
    .slots_per_segment = 1,
};
const ctrl_size_max_bytes: usize = @intCast(buffer_module.ctrl_size_bytes(geometry_max));
/// The control region of the fuzzed buffer (no allocation): one run at a time.
var ctrl_memory: [ctrl_size_max_bytes]u8 align(constants.buffer_cache_line_bytes) = undefined;
var running = false;

fn holder_bit(holder: u32) u64 {
    return buffer_module.holder_bit(holder);
}

// -------------------------------------------------------------------------------------------
// The simulated processes' identities: the world both the model and the buffer observe.

const Identity = struct { pid: u32 = 0, start_time: u64 = 0, alive: bool = false };
var identities: [process_count_max]Identity = @splat(.{});

/// The `debug_identity_alive` hook: a process runs while its current identity is alive; a
/// killed or replaced (restarted) identity is dead.
fn identity_alive(pid: u32, start_time: u64) bool {
    for (identities) |identity| {
        if (identity.pid == pid and identity.start_time == start_time) return identity.alive;
    }
    return false;
}

// -------------------------------------------------------------------------------------------
// The reference model.

const Place = enum { free, linked, detached };
const Pool = enum(u1) { regular, reserved };

const SlotModel = struct {
    /// Free (claimable), linked on its key's chain, or detached (failed or force-removed while
    /// referenced; freed by its last release).
    place: Place = .free,
    /// The key it holds (linked or detached).
    key: u32 = 0,
    state: State = .idle,
    accessed: bool = false,
    /// Holder loading the slot (set by Get/takeover, kept after a Ready commit).
    owner: ?u32 = null,
    /// Holders referencing the slot, one bit each.
    holders: u64 = 0,
    preallocated: bool = false,
    dirty: bool = false,
    /// Holder writing the dirty slot down (`take_dirty`).
    flusher: ?u32 = null,
    /// Commits so far (never reset).
    version: u32 = 0,
    /// Uses since the slot was installed (`Slot.reuses`): Gets answered hit, waiter or held,
    /// saturating.
    reuses: u16 = 0,
    /// `Slot.namespace`: the namespace index + 1 the slot counts in, 0 when it counts nowhere.
    namespace: u16 = 0,
};

/// The namespace a slot field (index + 1, or 0) counts its events in: 0 counts in the default.
fn field_index(field: u16) usize {
    return if (field == 0) 0 else field - 1;
}

/// Registered namespaces per epoch besides the default one (entry 0).
const namespace_count_max = 3;
/// What an allocation may take (`buffer.zig`'s `Quota`).
const Quota = struct { namespace: u16, grow: bool };

const EntryModel = struct {
    state: HolderState = .free,
    pid: u32 = 0,
    start_time: u64 = 0,
    closing: bool = false,
};

/// Who calls: a process view (pid + holder) or a view that holds no references.
const Caller = struct { pid: u32, holder: ?u32 };

const Reclaim = struct { holders: u32 = 0, refs: u64 = 0 };

const DirtyClaim = struct { slot: u32, key: u32 };

const Model = struct {
    slot_count_regular: u32,
    slot_count_reserved: u32,
    shards_per_block: u32,
    block_count: u32,
    /// The bucket of each block: the buffer's hash is an input to the model, not under test.
    block_buckets: [block_count_max]u32,
    bucket_count: u32,
    /// The namespace index of each block's keys (0: the default namespace).
    block_namespaces: [block_count_max]u16 = @splat(0),
    /// Namespace entries in use (1 + the registered ones) and their quotas and occupancy.
    namespace_count: u32 = 1,
    guarantees: [namespace_count_max + 1]u32 = @splat(0),
    caps: [namespace_count_max + 1]u32 = @splat(0),
    occupancy: [namespace_count_max + 1]u32 = @splat(0),
    /// Per namespace: Get hits, Get misses, Ready slots evicted.
    namespace_hits: [namespace_count_max + 1]u64 = @splat(0),
    namespace_misses: [namespace_count_max + 1]u64 = @splat(0),
    namespace_evictions: [namespace_count_max + 1]u64 = @splat(0),
    /// A kill between a slot's namespace field and its counter was injected and no recount
    /// has run since: the counters may disagree with the fields (the model tracks both).
    drift: bool = false,
    /// Drift was injected this epoch: a counter that was one too low may have let a
    /// namespace grow one slot past its cap, and the recount keeps the truth (it stays over
    /// until its own slots turn over), so the cap is no longer checked.
    drifted: bool = false,
    /// Coverage: recounts that repaired injected drift, victims refused to keep a guarantee,
    /// allocations of a namespace at its cap.
    drifts_repaired: u64 = 0,
    guarantee_refusals: u64 = 0,
    allocations_at_cap: u64 = 0,

    slots: [slot_count_max]SlotModel = @splat(.{}),
    /// The chains: key -> the slot linked for it.
    resident: [key_count_max]?u32 = @splat(null),
    fresh: [2]u32 = .{ 0, 0 },
    cursor: [2]u32 = .{ 0, 0 },
    entries: [holders_max]EntryModel = @splat(.{}),
    /// Bit h set: entry h is marked dead.
    dead: u64 = 0,
    counters: [counter_count]u64 = @splat(0),
    /// Pid of a dead process that still holds the bucket's lock, else 0.
    dead_locks: [bucket_count_max]u32 = @splat(0),
    /// Registrations that found the holder table full and reclaimed it first (coverage).
    full_table_registrations: u64 = 0,

    fn slot_count(model: *const Model) u32 {
        return model.slot_count_regular + model.slot_count_reserved;
    }

    fn key_count(model: *const Model) u32 {
        return model.block_count * model.shards_per_block;
    }

    fn key_of(model: *const Model, block: u32, shard: u32) u32 {
        assert(block < model.block_count and shard < model.shards_per_block);
        return block * model.shards_per_block + shard;
    }

    fn key_block(model: *const Model, key: u32) u32 {
        return key / model.shards_per_block;
    }

    fn key_shard(model: *const Model, key: u32) u32 {
        return key % model.shards_per_block;
    }

    fn key_bucket(model: *const Model, key: u32) u32 {
        return model.block_buckets[model.key_block(key)];
    }

    fn count(model: *Model, counter: Counter, amount: u64) void {
        model.counters[@intFromEnum(counter)] += amount;
    }

    fn dirty_gauge_down(model: *Model) void {
        assert(model.counters[@intFromEnum(Counter.dirty_slots)] > 0);
        model.counters[@intFromEnum(Counter.dirty_slots)] -= 1;
    }

    fn holds(model: *const Model, slot: u32, holder: u32) bool {
        return model.slots[slot].holders & holder_bit(holder) != 0;
    }

    // --- Holders ------------------------------------------------------------------------

    /// The entries marked dead (kept with `entries`: see `check_dead_mask`).
    fn dead_mask(model: *const Model) u64 {
        return model.dead;
    }

    fn check_dead_mask(model: *const Model) void {
        var mask: u64 = 0;
        for (model.entries, 0..) |entry, index| {
            if (entry.state == .dead) mask |= holder_bit(@intCast(index));
        }
        assert(mask == model.dead);
    }

    fn mark_dead(model: *Model, holder: u32) void {
        if (model.entries[holder].state != .live) return;
        model.entries[holder].state = .dead;
        model.dead |= holder_bit(holder);
        model.count(.dead_holders, 1);
    }

    /// Whether holder `holder` runs, as `caller` judges it; a dead live entry is marked dead.
    fn holder_alive(model: *Model, caller: Caller, holder: u32) bool {
        const entry = model.entries[holder];
        if (entry.state != .live) return false;
        if (entry.pid == caller.pid and caller.holder == holder) return true;
        if (identity_alive(entry.pid, entry.start_time)) return true;
        model.mark_dead(holder);
        return false;
    }

    /// Checks every live entry; returns the dead mask.
    fn scan(model: *Model, caller: Caller) u64 {
        for (0..holders_max) |index| {
            if (model.entries[index].state == .live) _ = model.holder_alive(caller, @intCast(index));
        }
        return model.dead_mask();
    }

    // --- Bucket locks ---------------------------------------------------------------------

    /// A blocking acquisition: a lock left by a dead process is stolen (its entry is judged
    /// and marked dead on the way).
    fn acquire(model: *Model, caller: Caller, bucket: u32) void {
        const dead_pid = model.dead_locks[bucket];
        if (dead_pid != 0) {
            assert(dead_pid != caller.pid);
            for (0..holders_max) |index| {
                const entry = model.entries[index];
                if (entry.pid != dead_pid or entry.state != .live) continue;
                // The fuzzer never lets a pid that died holding a lock be reused.
                assert(!model.holder_alive(caller, @intCast(index)));
            }
            model.dead_locks[bucket] = 0;
            model.count(.lock_recoveries, 1);
        }
        model.count(.lock_acquisitions, 1);
    }

    /// A try-lock (eviction of a slot of another bucket): fails on a lock still held.
    fn try_acquire(model: *Model, bucket: u32) bool {
        if (model.dead_locks[bucket] != 0) return false;
        model.count(.lock_acquisitions, 1);
        return true;
    }

    // --- Slots ----------------------------------------------------------------------------

    /// Drops references of (dead) holders `stale`; an owner or flusher among them leaves its
    /// role, so waiters take over and the next flusher takes the debt.
    fn drop_refs(model: *Model, slot_index: u32, stale: u64) void {
        const slot = &model.slots[slot_index];
        assert(stale != 0 and slot.holders & stale == stale);
        slot.holders &= ~stale;
        if (slot.owner) |owner| {
            if (stale & holder_bit(owner) != 0) slot.owner = null;
        }
        if (slot.flusher) |flusher| {
            if (stale & holder_bit(flusher) != 0) slot.flusher = null;
        }
        model.count(.refs_reclaimed, @popCount(stale));
    }

    /// Drops the references of holders marked dead; returns whether none is left.
    fn drop_dead_refs(model: *Model, slot_index: u32) bool {
        const stale = model.slots[slot_index].holders & model.dead_mask();
        if (stale != 0) model.drop_refs(slot_index, stale);
        return model.slots[slot_index].holders == 0;
    }

    fn unlink(model: *Model, slot_index: u32) void {
        const slot = &model.slots[slot_index];
        assert(slot.place == .linked);
        assert(model.resident[slot.key] == slot_index);
        model.resident[slot.key] = null;
        slot.place = .detached;
        // Every way off a chain stops counting (an eviction's `take_counted` already did).
        model.uncount(slot_index);
    }

    fn free_slot(model: *Model, slot_index: u32) void {
        const slot = &model.slots[slot_index];
        assert(slot.holders == 0 and slot.place != .linked);
        model.uncount(slot_index);
        if (slot.dirty) model.dirty_gauge_down();
        slot.* = .{ .version = slot.version };
    }

    fn clear_dirty(model: *Model, slot_index: u32) void {
        if (!model.slots[slot_index].dirty) return;
        model.slots[slot_index].dirty = false;
        model.dirty_gauge_down();
    }

    fn install(model: *Model, caller: Caller, slot_index: u32, key: u32, owner: bool) void {
        const slot = &model.slots[slot_index];
        assert(slot.holders == 0 and !slot.dirty and slot.flusher == null);
        assert(model.resident[key] == null);
        slot.place = .linked;
        slot.key = key;
        slot.state = .idle;
        slot.accessed = owner;
        slot.reuses = 0;
        slot.owner = if (owner) caller.holder.? else null;
        slot.preallocated = !owner;
        if (owner) slot.holders = holder_bit(caller.holder.?);
        model.resident[key] = slot_index;
        const namespace = model.namespace_of(key);
        assert(slot.namespace == 0);
        slot.namespace = namespace + 1;
        model.occupancy[namespace] += 1;
    }

    // --- Namespaces ---------------------------------------------------------------------

    fn namespace_of(model: *const Model, key: u32) u16 {
        return model.block_namespaces[model.key_block(key)];
    }

    fn uncount(model: *Model, slot_index: u32) void {
        const slot = &model.slots[slot_index];
        if (slot.namespace == 0) return;
        const counter = &model.occupancy[slot.namespace - 1];
        if (counter.* > 0) counter.* -= 1;
        slot.namespace = 0;
    }

    fn quota_for(model: *const Model, namespace: u16) Quota {
        return .{ .namespace = namespace, .grow = model.occupancy[namespace] < model.caps[namespace] };
    }

    fn evictable(model: *const Model, field: u16, quota: Quota) bool {
        if (field == quota.namespace + 1) return true;
        if (!quota.grow) return false;
        if (field == 0) return true;
        return model.occupancy[field - 1] > model.guarantees[field - 1];
    }

    fn evictable_counted(model: *Model, field: u16, quota: Quota) bool {
        const allowed = model.evictable(field, quota);
        if (!allowed and quota.grow and field != 0) model.guarantee_refusals += 1;
        return allowed;
    }

    fn take_counted(model: *Model, slot_index: u32, quota: Quota) bool {
        const slot = &model.slots[slot_index];
        if (slot.namespace == 0) return quota.grow;
        if (slot.namespace == quota.namespace + 1) {
            model.uncount(slot_index);
            return true;
        }
        if (!quota.grow) return false;
        const index = slot.namespace - 1;
        if (model.occupancy[index] <= model.guarantees[index]) {
            model.guarantee_refusals += 1;
            return false;
        }
        model.occupancy[index] -= 1;
        slot.namespace = 0;
        return true;
    }

    /// `recount_namespaces`: every bucket lock in order, then the counters from the chains.
    fn recount(model: *Model, caller: Caller) void {
        for (0..model.bucket_count) |bucket| model.acquire(caller, @intCast(bucket));
        model.occupancy = @splat(0);
        for (model.slots[0..model.slot_count()]) |*slot| {
            slot.namespace = 0;
            if (slot.place != .linked) continue;
            const namespace = model.namespace_of(slot.key);
            slot.namespace = namespace + 1;
            model.occupancy[namespace] += 1;
        }
        if (model.drift) model.drifts_repaired += 1;
        model.drift = false;
    }

    // --- Allocation: fresh slots, then CLOCK ---------------------------------------------

    fn pool_first(model: *const Model, pool: Pool) u32 {
        return if (pool == .regular) 0 else model.slot_count_regular;
    }

    fn pool_count(model: *const Model, pool: Pool) u32 {
        return if (pool == .regular) model.slot_count_regular else model.slot_count_reserved;
    }

    /// The next never-used slot of the pool, if any.
    fn take_fresh(model: *Model, pool: Pool) ?u32 {
        const used = &model.fresh[@intFromEnum(pool)];
        if (used.* == model.pool_count(pool)) return null;
        const slot_index = model.pool_first(pool) + used.*;
        used.* += 1;
        assert(model.slots[slot_index].place == .free);
        return slot_index;
    }

    /// CLOCK over one pool from its cursor: a lap of second chances (a set accessed bit is
    /// cleared and the slot passed over), then a lap on the raw cursor. Skipped: slots a live
    /// (or not yet marked dead) holder references, dirty slots, detached slots, slots whose
    /// bucket lock is held by someone else, and with `idle_only` Ready slots. A victim's dead
    /// references are dropped; a Ready victim is an eviction.
    fn clock(model: *Model, pool: Pool, bucket: u32, idle_only: bool, quota: Quota) ?u32 {
        const pool_slots = model.pool_count(pool);
        if (pool_slots == 0) return null;
        const cursor = &model.cursor[@intFromEnum(pool)];
        for (0..2 * pool_slots) |step| {
            const slot_index = model.pool_first(pool) + cursor.*;
            cursor.* = (cursor.* + 1) % pool_slots;
            const slot = &model.slots[slot_index];
            if (!model.evictable_counted(slot.namespace, quota)) continue;
            if (step < pool_slots) {
                const accessed = slot.accessed;
                slot.accessed = false;
                if (accessed) continue;
            }
            if (slot.holders & ~model.dead_mask() != 0) continue;
            if (slot.dirty) continue;
            switch (slot.place) {
                .free => if (quota.grow) return slot_index else continue,
                .detached => continue,
                .linked => {},
            }
            const victim_bucket = model.key_bucket(slot.key);
            if (victim_bucket != bucket and !model.try_acquire(victim_bucket)) continue;
            assert(model.drop_dead_refs(slot_index));
            if (idle_only and slot.state == .ready) continue;
            const victim_field = slot.namespace;
            if (!model.take_counted(slot_index, quota)) continue;
            if (slot.state == .ready) {
                model.count(.evictions, 1);
                model.namespace_evictions[field_index(victim_field)] += 1;
            }
            model.unlink(slot_index);
            slot.place = .free; // claimed by the caller: `install` links it
            return slot_index;
        }
        return null;
    }

    /// A namespace at its cap takes only its own slots (no fresh ones).
    fn allocate_once(model: *Model, bucket: u32, namespace: u16) ?u32 {
        const quota = model.quota_for(namespace);
        if (!quota.grow) model.allocations_at_cap += 1;
        if (quota.grow) {
            if (model.take_fresh(.regular)) |slot_index| return slot_index;
        }
        if (model.clock(.regular, bucket, false, quota)) |slot_index| return slot_index;
        if (quota.grow) {
            if (model.take_fresh(.reserved)) |slot_index| return slot_index;
        }
        return model.clock(.reserved, bucket, false, quota);
    }

    /// A full buffer looks for dead holders (every time: the fuzzer resets the rate limit)
    /// and tries once more when it found any.
    fn allocate_for_get(model: *Model, caller: Caller, bucket: u32, namespace: u16) ?u32 {
        if (model.allocate_once(bucket, namespace)) |slot_index| return slot_index;
        if (model.scan(caller) == 0) return null;
        return model.allocate_once(bucket, namespace);
    }

    // --- Operations -------------------------------------------------------------------------

    fn get(model: *Model, caller: Caller, mode: GetMode, keys: []const u32, results: []GetResult, slots: []u32) void {
        const me = caller.holder.?;
        for (keys, results, slots) |key, *result, *slot_out| {
            model.acquire(caller, model.key_bucket(key));
            if (model.resident[key]) |slot_index| {
                result.* = model.get_resident(me, slot_index, mode);
                slot_out.* = if (result.* == .absent) slot_none else slot_index;
                continue;
            }
            model.count(.misses, 1);
            model.namespace_misses[model.namespace_of(key)] += 1;
            if (mode == .lookup) {
                // A lookup allocates nothing: no fresh slot, no victim.
                slot_out.* = slot_none;
                result.* = .absent;
                continue;
            }
            if (model.allocate_for_get(caller, model.key_bucket(key), model.namespace_of(key))) |slot_index| {
                model.install(caller, slot_index, key, true);
                slot_out.* = slot_index;
                result.* = .owner;
            } else {
                model.count(.no_slot, 1);
                slot_out.* = slot_none;
                result.* = .no_slot;
            }
        }
    }

    fn get_resident(model: *Model, me: u32, slot_index: u32, mode: GetMode) GetResult {
        const slot = &model.slots[slot_index];
        _ = model.drop_dead_refs(slot_index);
        if (slot.holders & holder_bit(me) != 0) {
            if (mode != .write) slot.reuses +|= 1;
            return .held;
        }
        assert(slot.state == .idle or slot.state == .ready);
        if (slot.state == .ready) {
            slot.holders |= holder_bit(me);
            slot.accessed = true;
            if (mode != .write) slot.reuses +|= 1;
            model.count(.hits, 1);
            model.namespace_hits[field_index(slot.namespace)] += 1;
            return .hit;
        }
        model.count(.misses, 1);
        model.namespace_misses[field_index(slot.namespace)] += 1;
        if (slot.holders == 0) {
            // A lookup leaves an idle slot nobody holds as it is.
            if (mode == .lookup) return .absent;
            // An idle slot nobody holds (prewarmed, or given up by its owner): take it over.
            if (slot.preallocated) model.count(.prealloc_hits, 1);
            slot.preallocated = false;
            slot.owner = me;
            slot.accessed = true;
            slot.holders |= holder_bit(me);
            return .owner;
        }
        slot.holders |= holder_bit(me);
        slot.reuses +|= 1;
        return .waiter;
    }

    fn prealloc(model: *Model, caller: Caller, keys: []const u32, results: []PreallocResult) void {
        for (keys, results) |key, *result| {
            const bucket = model.key_bucket(key);
            model.acquire(caller, bucket);
            if (model.resident[key] != null) {
                result.* = .exists;
                continue;
            }
            const quota = model.quota_for(model.namespace_of(key));
            const fresh = if (quota.grow) model.take_fresh(.regular) orelse model.take_fresh(.reserved) else null;
            const found = fresh orelse model.clock(.reserved, bucket, true, quota);
            if (found) |slot_index| {
                model.install(caller, slot_index, key, false);
                model.count(.preallocs, 1);
                result.* = .allocated;
            } else {
                result.* = .no_slot;
            }
        }
    }

    fn commit(model: *Model, caller: Caller, slot_index: u32, code: u8) CommitResult {
        const me = caller.holder.?;
        const slot = &model.slots[slot_index];
        if (slot.owner != me) return .not_owner;
        if (slot.state != .idle) return .not_idle;
        assert(slot.holders & holder_bit(me) != 0);
        const state: State = @enumFromInt(code & ~buffer_module.commit_dirty_bit);
        if (state == .ready) {
            if (code & buffer_module.commit_dirty_bit != 0 and slot.place != .detached) {
                // A detached (force-removed) slot owes nothing: its commit pays the debt at
                // once (no flusher could take it), so the gauge is unchanged.
                assert(!slot.dirty);
                slot.dirty = true;
                model.count(.dirty_slots, 1);
            }
            slot.state = .ready;
            model.count(.commits_ready, 1);
        } else {
            // Failures are not remembered: the slot leaves its chain at once.
            if (slot.place == .linked) {
                model.acquire(caller, model.key_bucket(slot.key));
                model.unlink(slot_index);
            }
            slot.state = state;
            model.count(.commits_failed, 1);
        }
        slot.version +%= 1;
        return .ok;
    }

    /// A wait with timeout 0 on a slot the caller references.
    fn wait(model: *Model, caller: Caller, slot_index: u32) WaitResult {
        const me = caller.holder.?;
        const slot = &model.slots[slot_index];
        assert(slot.holders & holder_bit(me) != 0);
        switch (slot.state) {
            .ready => return .ready,
            .failed => return .failed,
            .missing => return .missing,
            .idle => {},
        }
        const owner = slot.owner;
        if (owner != me) {
            const orphaned = if (owner) |holder| !model.holder_alive(caller, holder) else true;
            if (orphaned) {
                // Take over: the dead owner's reference goes; ours stays.
                if (slot.place == .linked) model.acquire(caller, model.key_bucket(slot.key));
                if (owner) |holder| {
                    if (slot.holders & holder_bit(holder) != 0) {
                        slot.holders &= ~holder_bit(holder);
                        model.count(.refs_reclaimed, 1);
                    }
                }
                slot.owner = me;
                slot.accessed = true;
                model.count(.takeovers, 1);
                return .takeover;
            }
        }
        model.count(.wait_timeouts, 1);
        return .idle;
    }

    fn release(model: *Model, caller: Caller, slot_indices: []const u32) u32 {
        const me = caller.holder.?;
        var released: u32 = 0;
        for (slot_indices) |slot_index| {
            const slot = &model.slots[slot_index];
            if (slot.place == .linked) model.acquire(caller, model.key_bucket(slot.key));
            if (slot.holders & holder_bit(me) == 0) continue;
            // The owner gives up without committing: waiters may take over.
            if (slot.state == .idle and slot.owner == me) slot.owner = null;
            slot.holders &= ~holder_bit(me);
            released += 1;
            if (slot.place == .detached and slot.holders == 0) model.free_slot(slot_index);
        }
        return released;
    }

    fn touch(model: *Model, caller: Caller, blocks: []const u32) u64 {
        var touched: u64 = 0;
        for (blocks) |block| {
            model.acquire(caller, model.block_buckets[block]);
            for (0..model.shards_per_block) |shard| {
                const key = model.key_of(block, @intCast(shard));
                const slot_index = model.resident[key] orelse continue;
                if (model.slots[slot_index].state != .ready) continue;
                model.slots[slot_index].accessed = true;
                touched += 1;
            }
        }
        model.count(.touched, touched);
        return touched;
    }

    fn ready(model: *const Model, key: u32) bool {
        const slot_index = model.resident[key] orelse return false;
        return model.slots[slot_index].state == .ready;
    }

    fn lookup(model: *Model, caller: Caller, keys: []const u32, out: []u8) void {
        for (keys, out) |key, *present| {
            model.acquire(caller, model.key_bucket(key));
            present.* = @intFromBool(model.ready(key));
        }
    }

    /// `Buffer.list_ready`: from slot `cursor.*` on, the keys of up to `out.len` Ready slots
    /// linked on a chain, each read under its bucket's lock; the cursor moves past the last
    /// slot scanned (0 once every slot was). Returns how many were listed.
    fn list_ready(model: *Model, caller: Caller, cursor: *u32, out: []u32) u32 {
        const total = model.slot_count();
        assert(cursor.* < total);
        var listed: u32 = 0;
        var position = cursor.*;
        while (position < total and listed < out.len) : (position += 1) {
            const slot = &model.slots[position];
            if (slot.place != .linked or slot.state != .ready) continue;
            model.acquire(caller, model.key_bucket(slot.key));
            out[listed] = slot.key;
            listed += 1;
        }
        cursor.* = if (position >= total) 0 else position;
        return listed;
    }

    fn lookup_blocks(model: *Model, caller: Caller, blocks: []const u32, shards_per_block: u32, out: []u8) void {
        for (blocks, out) |block, *present| {
            model.acquire(caller, model.block_buckets[block]);
            var ready_shards: u32 = 0;
            for (0..@min(shards_per_block, model.shards_per_block)) |shard| {
                ready_shards += @intFromBool(model.ready(model.key_of(block, @intCast(shard))));
            }
            present.* = @intFromBool(ready_shards == shards_per_block);
        }
    }

    /// Removes keys (or whole blocks when `shards` is null): an unreferenced slot (after its
    /// dead references are dropped) is freed, a referenced one detached only with `force`.
    /// Removal forgives write-back debt. Returns the Ready shards removed.
    fn remove(model: *Model, caller: Caller, blocks: []const u32, shards: ?[]const u32, force: bool) u64 {
        var removed: u64 = 0;
        // One lock per distinct bucket (a batch is far below one chunk).
        for (0..bucket_count_max) |bucket_index| {
            const bucket: u32 = @intCast(bucket_index);
            var selected_keys: [batch_max * shards_per_block_max]u32 = undefined;
            var selected: usize = 0;
            for (blocks, 0..) |block, index| {
                if (model.block_buckets[block] != bucket) continue;
                if (shards) |shard_list| {
                    selected_keys[selected] = model.key_of(block, shard_list[index]);
                    selected += 1;
                } else {
                    for (0..model.shards_per_block) |shard| {
                        selected_keys[selected] = model.key_of(block, @intCast(shard));
                        selected += 1;
                    }
                }
            }
            if (selected == 0) continue;
            model.acquire(caller, bucket);
            model.count(.remove_lock_acquisitions, 1);
            for (selected_keys[0..selected]) |key| {
                const slot_index = model.resident[key] orelse continue;
                const slot = &model.slots[slot_index];
                const was_ready = slot.state == .ready;
                if (model.drop_dead_refs(slot_index)) {
                    model.unlink(slot_index);
                    model.free_slot(slot_index);
                } else if (force) {
                    model.unlink(slot_index);
                    model.clear_dirty(slot_index);
                } else {
                    continue;
                }
                removed += @intFromBool(was_ready);
            }
        }
        model.count(.removed, removed);
        return removed;
    }

    /// Claims up to `claims.len` dirty slots from `cursor.*` on (one pass over every slot):
    /// skipped are slots the caller already references and slots a live flusher writes; a
    /// dead flusher's claim passes to the caller.
    fn take_dirty(model: *Model, caller: Caller, cursor: *u32, claims: []DirtyClaim) u32 {
        const me = caller.holder.?;
        const total = model.slot_count();
        var position = cursor.* % total;
        var taken: u32 = 0;
        var scanned: u32 = 0;
        while (scanned < total and taken < claims.len) : (scanned += 1) {
            const slot_index = position;
            position = (position + 1) % total;
            const slot = &model.slots[slot_index];
            if (!slot.dirty) continue;
            if (slot.flusher) |flusher| {
                if (flusher == me or model.holder_alive(caller, flusher)) continue;
            }
            if (slot.place != .linked) continue;
            model.acquire(caller, model.key_bucket(slot.key));
            assert(slot.state == .ready);
            if (slot.holders & holder_bit(me) != 0) continue;
            slot.flusher = me;
            slot.holders |= holder_bit(me);
            claims[taken] = .{ .slot = slot_index, .key = slot.key };
            taken += 1;
        }
        cursor.* = position;
        return taken;
    }

    fn clean(model: *Model, caller: Caller, slot_indices: []const u32, written: []const u8) u32 {
        const me = caller.holder.?;
        var cleaned: u32 = 0;
        for (slot_indices, written) |slot_index, ok| {
            const slot = &model.slots[slot_index];
            if (slot.place != .linked) continue;
            model.acquire(caller, model.key_bucket(slot.key));
            if (slot.flusher != me) continue;
            slot.flusher = null;
            if (ok != 0 and slot.dirty) {
                model.clear_dirty(slot_index);
                model.count(.flushed, 1);
                cleaned += 1;
            }
        }
        return cleaned;
    }

    /// The caller is the last to close when every other live holder is closing or dead
    /// (judged in table order, stopping at the first live one that is not closing).
    fn mark_closing(model: *Model, caller: Caller, closing: bool) bool {
        const me = caller.holder.?;
        model.entries[me].closing = closing;
        if (!closing) return false;
        for (0..holders_max) |index| {
            if (index == me) continue;
            const entry = model.entries[index];
            if (entry.state != .live or entry.closing) continue;
            if (model.holder_alive(caller, @intCast(index))) return false;
        }
        return true;
    }

    /// Marks the dead, steals their locks, drops every reference they left (slot by slot) and
    /// frees their entries.
    fn reclaim_dead(model: *Model, caller: Caller) Reclaim {
        const claimed = model.scan(caller);
        var report = Reclaim{};
        if (claimed == 0) return report;
        for (0..bucket_count_max) |bucket| {
            const dead_pid = model.dead_locks[bucket];
            if (dead_pid == 0) continue;
            for (model.entries, 0..) |entry, index| {
                if (claimed & holder_bit(@intCast(index)) == 0 or entry.pid != dead_pid) continue;
                model.acquire(caller, @intCast(bucket));
                break;
            }
        }
        for (0..model.slot_count()) |slot_index_usize| {
            const slot_index: u32 = @intCast(slot_index_usize);
            const slot = &model.slots[slot_index];
            const stale = slot.holders & claimed;
            if (stale == 0) continue;
            if (slot.place == .linked) model.acquire(caller, model.key_bucket(slot.key));
            model.drop_refs(slot_index, stale);
            report.refs += @popCount(stale);
            if (slot.place == .detached and slot.holders == 0) model.free_slot(slot_index);
        }
        for (&model.entries, 0..) |*entry, index| {
            if (claimed & holder_bit(@intCast(index)) == 0) continue;
            entry.* = .{};
            model.dead &= ~holder_bit(@intCast(index));
            report.holders += 1;
        }
        model.count(.holders_freed, report.holders);
        model.recount(caller);
        return report;
    }

    /// A live entry of the same pid with another start time is a dead predecessor (pid
    /// reuse); the first free entry is taken; a full table is reclaimed once first.
    fn register(model: *Model, caller: Caller, pid: u32, start_time: u64) ?u32 {
        for (0..2) |attempt| {
            for (&model.entries, 0..) |*entry, index| {
                if (entry.state != .live or entry.pid != pid) continue;
                if (entry.start_time == start_time) return @intCast(index);
                model.mark_dead(@intCast(index));
            }
            for (&model.entries, 0..) |*entry, index| {
                if (entry.state != .free) continue;
                entry.* = .{ .state = .live, .pid = pid, .start_time = start_time };
                return @intCast(index);
            }
            if (attempt == 0) {
                model.full_table_registrations += 1;
                _ = model.reclaim_dead(caller);
            }
        }
        return null;
    }

    /// A process takes a bucket lock and dies holding it.
    fn hold_lock(model: *Model, caller: Caller, bucket: u32) void {
        model.acquire(caller, bucket);
        model.dead_locks[bucket] = caller.pid;
    }
};

// -------------------------------------------------------------------------------------------
// The harness: one epoch's world (a buffer, its model, the simulated processes).

const Op = enum {
    get,
    commit,
    commit_invalid,
    wait,
    release,
    touch,
    prealloc,
    remove,
    lookup,
    list_ready,
    take_dirty,
    clean,
    mark_closing,
    kill,
    restart,
    reclaim,
    lock_death,
};
const op_count = @typeInfo(Op).@"enum".fields.len;

/// Relative weights of the operations before the swarm's per-epoch scaling.
const op_weights_base = std.enums.directEnumArray(Op, u32, 0, .{
    .get = 30,
    .commit = 16,
    .commit_invalid = 1,
    .wait = 8,
    .release = 12,
    .touch = 4,
    .prealloc = 5,
    .remove = 4,
    .lookup = 3,
    .list_ready = 2,
    .take_dirty = 5,
    .clean = 5,
    .mark_closing = 2,
    .kill = 3,
    .restart = 4,
    .reclaim = 1,
    .lock_death = 0, // set per epoch: each recovery sleeps out a 10 ms lock slice
});

const Process = struct {
    holder: u32 = 0,
    view: Buffer = undefined,
    /// The position `take_dirty` continues from (kept by the flusher between calls).
    take_cursor: u32 = 0,
    /// Died holding a bucket lock: its pid is never reused (a live process with the locker's
    /// pid keeps the lock from being stolen until the lock timeout).
    pid_retired: bool = false,
};

const log_entries_max = 24;
const log_entry_size_bytes = 160;

/// The last operations, printed when a check fails.
const OpLog = struct {
    entries: [log_entries_max][log_entry_size_bytes]u8 = undefined,
    lengths: [log_entries_max]usize = @splat(0),
    next: usize = 0,
    total: u64 = 0,

    fn add(log: *OpLog, comptime format: []const u8, args: anytype) void {
        const slot = log.next;
        const text = std.fmt.bufPrint(&log.entries[slot], format, args) catch &log.entries[slot];
        log.lengths[slot] = text.len;
        log.next = (log.next + 1) % log_entries_max;
        log.total += 1;
    }

    fn dump(log: *const OpLog) void {
        const shown = @min(log.total, log_entries_max);
        for (0..shown) |age| {
            const index = (log.next + log_entries_max - shown + age) % log_entries_max;
            std.debug.print("  {s}\n", .{log.entries[index][0..log.lengths[index]]});
        }
    }
};

const Mismatch = error{ModelMismatch};

fn check(what: []const u8, index: u64, expected: u64, actual: u64) Mismatch!void {
    if (expected == actual) return;
    std.debug.print("buffer fuzz mismatch: {s} [{d}]: model {d}, buffer {d}\n", .{ what, index, expected, actual });
    return error.ModelMismatch;
}

fn check_true(what: []const u8, index: u64, condition: bool) Mismatch!void {
    return check(what, index, 1, @intFromBool(condition));
}

/// One epoch's world: the buffer's geometry, the keys (blocks x shards) and the processes.
const Config = struct {
    geometry: buffer_module.Geometry,
    block_count: u32,
    shards_per_block: u32,
    process_count: u32,
    /// Draw registered namespaces with quotas and spread the blocks over them (the random
    /// epochs); the scripted scenarios keep every key in the default namespace.
    namespaces: bool = false,
};

/// A view and who it is, for calls that take no references.
const Who = struct { view: Buffer, caller: Caller };

const World = struct {
    random: std.Random,
    model: Model,
    base: Buffer,
    processes: [process_count_max]Process = @splat(.{}),
    process_count: u32,
    block_ids: [block_count_max]BlockId,
    weights: [op_count]u32,
    weight_total: u32,
    /// A process at this many references releases instead of getting more (per epoch: from
    /// one reference each to pinning the whole buffer).
    hold_limit: u32,
    next_pid: u32 = fake_pid_first,
    next_start_time: u64 = 1000,
    log: OpLog = .{},
    /// The epoch's configuration, printed with a failure.
    description: [log_entry_size_bytes]u8 = undefined,
    description_len: usize = 0,
    stats: *Summary,

    fn init(world: *World, random: std.Random, stats: *Summary) !void {
        try world.init_config(.{
            .geometry = .{
                .shard_size_bytes = 64,
                .slot_count_regular = random.intRangeAtMost(u32, 1, slot_count_regular_max),
                .slot_count_reserved = random.intRangeAtMost(u32, 0, slot_count_reserved_max),
                .bucket_count = random.intRangeAtMost(u32, 1, bucket_count_max),
                .slots_per_segment = random.intRangeAtMost(u32, 1, slots_per_segment_max),
            },
            .block_count = random.intRangeAtMost(u32, 1, block_count_max),
            .shards_per_block = random.intRangeAtMost(u32, 1, shards_per_block_max),
            .process_count = random.intRangeAtMost(u32, 1, process_count_max),
            .namespaces = true,
        }, random, stats);
    }

    /// A fresh buffer of `config`; `random` draws the block ids and the operation mix.
    fn init_config(world: *World, config: Config, random: std.Random, stats: *Summary) !void {
        const geometry = config.geometry;
        assert(geometry.slot_count_regular <= slot_count_regular_max);
        assert(geometry.slot_count_reserved <= slot_count_reserved_max);
        assert(geometry.bucket_count <= bucket_count_max);
        assert(config.block_count <= block_count_max and config.shards_per_block <= shards_per_block_max);
        assert(config.process_count >= 1 and config.process_count <= process_count_max);
        const size_bytes = buffer_module.ctrl_size_bytes(geometry);
        assert(size_bytes <= ctrl_memory.len);
        const base_address = @intFromPtr(&ctrl_memory);
        if (Buffer.init(base_address, ctrl_memory.len, geometry, 0) != .ok) return error.ModelMismatch;
        const base = Buffer.open(base_address).?;
        world.* = .{
            .random = random,
            .model = .{
                .slot_count_regular = geometry.slot_count_regular,
                .slot_count_reserved = geometry.slot_count_reserved,
                .shards_per_block = config.shards_per_block,
                .block_count = config.block_count,
                .block_buckets = undefined,
                .bucket_count = geometry.bucket_count,
            },
            .base = base,
            .process_count = config.process_count,
            .block_ids = undefined,
            .weights = undefined,
            .weight_total = 0,
            .stats = stats,
            .hold_limit = undefined,
        };
        // Mostly a fair share of the slots per process; now and then enough to pin them all.
        const slots_total = geometry.slot_count_regular + geometry.slot_count_reserved;
        world.hold_limit = if (random.uintLessThan(u32, 4) == 0)
            random.intRangeAtMost(u32, 1, slots_total)
        else
            random.intRangeAtMost(u32, 1, @max(1, slots_total / world.process_count));
        // Namespaces: entry 0 (the default) has no guarantee and no cap; up to three more get
        // guarantees that add up to at most the regular slots, and caps at or above them.
        const model = &world.model;
        model.caps[0] = slots_total;
        model.namespace_count = if (config.namespaces) 1 + random.uintAtMost(u32, namespace_count_max) else 1;
        var tags: [namespace_count_max + 1]u64 = @splat(0);
        var guaranteed: u32 = 0;
        for (1..model.namespace_count) |index| {
            tags[index] = (random.int(u64) | 1) +% (@as(u64, index) << 56); // distinct, not 0
            const guarantee = random.uintAtMost(u32, geometry.slot_count_regular - guaranteed);
            const cap = random.intRangeAtMost(u32, guarantee, slots_total);
            guaranteed += guarantee;
            const registered = base.register_namespace(tags[index], guarantee, cap) catch return error.ModelMismatch;
            try check("namespace index", index, index, registered);
            model.guarantees[index] = guarantee;
            model.caps[index] = cap;
        }
        for (&world.block_ids, 0..) |*id, block| {
            random.bytes(id);
            const namespace: u16 = @intCast(random.uintLessThan(u32, model.namespace_count));
            if (namespace != 0) std.mem.writeInt(u64, id[0..8], tags[namespace], .little);
            id[8] = @intCast(block); // distinct blocks
            model.block_namespaces[block] = namespace;
            model.block_buckets[block] = base.bucket_of(id);
            try check("block namespace", block, namespace, base.namespace_of(id));
        }
        // Swarm testing: each epoch scales every weight by 0..3 (some operations never run).
        world.weight_total = 0;
        for (&world.weights, op_weights_base) |*weight, base_weight| {
            weight.* = base_weight * random.uintLessThan(u32, 4);
            world.weight_total += weight.*;
        }
        world.weights[@intFromEnum(Op.get)] += op_weights_base[@intFromEnum(Op.get)];
        world.weights[@intFromEnum(Op.release)] += op_weights_base[@intFromEnum(Op.release)];
        world.weight_total += op_weights_base[@intFromEnum(Op.get)] + op_weights_base[@intFromEnum(Op.release)];
        if (random.uintLessThan(u32, 3) == 0) {
            world.weights[@intFromEnum(Op.lock_death)] = 1;
            world.weight_total += 1;
        }
        for (0..world.process_count) |index| {
            identities[index] = .{ .pid = world.fresh_pid(), .start_time = world.fresh_start_time(), .alive = true };
            try world.register_process(@intCast(index));
        }
        for (world.process_count..process_count_max) |index| identities[index] = .{};
        const description = std.fmt.bufPrint(&world.description, "regular {d} reserved {d} buckets {d} per-segment {d} blocks {d} x {d} shards, {d} processes, hold limit {d}", .{
            geometry.slot_count_regular, geometry.slot_count_reserved,
            geometry.bucket_count,       geometry.slots_per_segment,
            world.model.block_count,     world.model.shards_per_block,
            world.process_count,         world.hold_limit,
        }) catch unreachable;
        world.description_len = description.len;
        world.log.add("epoch: {s}", .{description});
    }

    fn fresh_pid(world: *World) u32 {
        world.next_pid += 1;
        return world.next_pid;
    }

    fn fresh_start_time(world: *World) u64 {
        world.next_start_time += 1;
        return world.next_start_time;
    }

    fn caller_of(world: *const World, process: u32) Caller {
        return .{ .pid = identities[process].pid, .holder = world.processes[process].holder };
    }

    fn base_caller(world: *const World) Caller {
        return .{ .pid = world.base.pid, .holder = null };
    }

    /// A process or the reference-free base view, for calls that take no references.
    fn any_caller(world: *World) Who {
        if (world.live_process()) |process| {
            if (world.random.boolean()) return .{ .view = world.processes[process].view, .caller = world.caller_of(process) };
        }
        return base_who(world);
    }

    fn register_process(world: *World, process: u32) !void {
        const identity = identities[process];
        var view = world.base;
        view.pid = identity.pid;
        const caller = Caller{ .pid = identity.pid, .holder = null };
        const expected = world.model.register(caller, identity.pid, identity.start_time);
        const holder = view.register_identity(identity.pid, identity.start_time) catch |err| {
            std.debug.print("buffer fuzz mismatch: register_identity failed: {s}\n", .{@errorName(err)});
            return error.ModelMismatch;
        };
        try check("register holder", process, expected.?, holder);
        view.holder = holder;
        world.processes[process] = .{ .holder = holder, .view = view, .pid_retired = world.processes[process].pid_retired };
    }

    fn live_process(world: *World) ?u32 {
        return world.pick_process(true);
    }

    fn pick_process(world: *World, alive: bool) ?u32 {
        var candidates: [process_count_max]u32 = undefined;
        var found: usize = 0;
        for (0..world.process_count) |index| {
            if (identities[index].alive != alive) continue;
            candidates[found] = @intCast(index);
            found += 1;
        }
        if (found == 0) return null;
        return candidates[world.random.uintLessThan(usize, found)];
    }

    fn random_key(world: *World) u32 {
        return world.random.uintLessThan(u32, world.model.key_count());
    }

    fn random_block(world: *World) u32 {
        return world.random.uintLessThan(u32, world.model.block_count);
    }

    /// Slots `holder` references, filtered by `want`.
    const Held = enum { any, owned, waitable, releasable, claimed };

    /// A live process that holds a slot of kind `want`, when one does, else any live one.
    fn process_holding(world: *World, want: Held) u32 {
        var candidates: [process_count_max]u32 = undefined;
        var found: usize = 0;
        for (0..world.process_count) |index| {
            if (!identities[index].alive) continue;
            var held: [slot_count_max]u32 = undefined;
            if (world.held_slots(world.processes[index].holder, want, &held) == 0) continue;
            candidates[found] = @intCast(index);
            found += 1;
        }
        if (found == 0) return world.live_process().?;
        return candidates[world.random.uintLessThan(usize, found)];
    }

    fn held_slots(world: *World, holder: u32, want: Held, out: []u32) usize {
        var found: usize = 0;
        for (0..world.model.slot_count()) |index| {
            const slot = world.model.slots[index];
            if (slot.holders & holder_bit(holder) == 0) continue;
            const keep = switch (want) {
                .any, .waitable => true,
                .owned => slot.owner == holder and slot.state == .idle,
                // Flush claims are released by `op_clean`; an owner gives its load up now
                // and then, else it commits.
                .releasable => slot.flusher != holder and
                    (slot.owner != holder or slot.state != .idle or world.random.uintLessThan(u32, 8) == 0),
                .claimed => slot.flusher == holder,
            };
            if (!keep) continue;
            out[found] = @intCast(index);
            found += 1;
        }
        return found;
    }

    /// Picks up to `limit` distinct entries of `candidates` (shuffled in place).
    fn pick_subset(world: *World, candidates: []u32, limit: usize) []u32 {
        world.random.shuffle(u32, candidates);
        const wanted = @min(candidates.len, world.random.intRangeAtMost(usize, 1, limit));
        return candidates[0..wanted];
    }

    fn step(world: *World) !void {
        // Deterministic holder scans: every full-buffer miss scans (see the file comment).
        world.base.holder_table.last_scan_ns.store(0, .monotonic);
        if (world.live_process() == null) return world.op_restart();
        var choice = world.random.uintLessThan(u32, world.weight_total);
        const op: Op = for (world.weights, 0..) |weight, index| {
            if (choice < weight) break @enumFromInt(index);
            choice -= weight;
        } else unreachable;
        world.stats.ops[@intFromEnum(op)] += 1;
        switch (op) {
            .get => try world.op_get(),
            .commit => try world.op_commit(),
            .commit_invalid => try world.op_commit_invalid(),
            .wait => try world.op_wait(),
            .release => try world.op_release(),
            .touch => try world.op_touch(),
            .prealloc => try world.op_prealloc(),
            .remove => try world.op_remove(),
            .lookup => try world.op_lookup(),
            .list_ready => try world.op_list_ready(),
            .take_dirty => try world.op_take_dirty(),
            .clean => try world.op_clean(),
            .mark_closing => try world.op_mark_closing(),
            .kill => try world.op_kill(),
            .restart => try world.op_restart(),
            .reclaim => try world.op_reclaim(),
            .lock_death => try world.op_lock_death(),
        }
    }

    fn random_keys(world: *World, keys: []u32) void {
        for (keys) |*key| key.* = world.random_key();
    }

    fn op_get(world: *World) !void {
        const process = world.live_process().?;
        const holder = world.processes[process].holder;
        var held: [slot_count_max]u32 = undefined;
        if (world.held_slots(holder, .any, &held) >= world.hold_limit) return world.op_release();
        var keys: [batch_max]u32 = undefined;
        const n = world.random.intRangeAtMost(usize, 1, batch_max);
        for (keys[0..n]) |*key| {
            key.* = world.random_key();
            // Mostly keys the process does not hold yet (a repeated Get answers `held`).
            if (world.model.resident[key.*]) |slot_index| {
                if (world.model.holds(slot_index, holder)) key.* = world.random_key();
            }
        }
        var results: [batch_max]GetResult = undefined;
        var slots: [batch_max]u32 = undefined;
        // Some Gets only look up (a no-fill load's): they never allocate nor take over. Some
        // are a dump's: no use counted.
        const mode: GetMode = switch (world.random.uintLessThan(u8, 6)) {
            0 => .lookup,
            1 => .write,
            else => .claim,
        };
        try world.exec_get(process, mode, keys[0..n], results[0..n], slots[0..n]);
    }

    /// Get `keys` as `process` in one batch; results and slots as the model predicted them.
    fn exec_get(world: *World, process: u32, mode: GetMode, keys: []const u32, results: []GetResult, slots: []u32) !void {
        assert(keys.len <= batch_max);
        const caller = world.caller_of(process);
        var ids: [batch_max]BlockId = undefined;
        var shards: [batch_max]u32 = undefined;
        for (keys, 0..) |key, index| {
            ids[index] = world.block_ids[world.model.key_block(key)];
            shards[index] = world.model.key_shard(key);
        }
        const before = world.model.occupancy;
        world.model.get(caller, mode, keys, results, slots);
        world.log.add("p{d}/h{d} get {s} keys {any} -> {any} slots {any}", .{ process, caller.holder.?, @tagName(mode), keys, results, slots });
        try world.check_guarantees(keys, before);
        var real_results: [batch_max]GetResult = undefined;
        var real_slots: [batch_max]u32 = undefined;
        const n = keys.len;
        world.processes[process].view.get_as(mode, ids[0..n], shards[0..n], .{ .results = real_results[0..n], .slots = real_slots[0..n] });
        for (0..n) |index| {
            world.stats.get_results[@intFromEnum(results[index])] += 1;
            try check("get result", index, @intFromEnum(results[index]), @intFromEnum(real_results[index]));
            try check("get slot", index, slots[index], real_slots[index]);
        }
    }

    fn op_commit(world: *World) !void {
        const process = world.process_holding(.owned);
        var owned: [slot_count_max]u32 = undefined;
        const found = world.held_slots(world.processes[process].holder, .owned, &owned);
        if (found == 0) return;
        const slots = world.pick_subset(owned[0..found], 2);
        var codes: [2]u8 = undefined;
        for (codes[0..slots.len]) |*code| {
            code.* = switch (world.random.uintLessThan(u32, 8)) {
                0, 1, 2 => @intFromEnum(State.ready),
                3, 4, 5 => @intFromEnum(State.ready) | buffer_module.commit_dirty_bit,
                6 => @intFromEnum(State.failed),
                7 => @intFromEnum(State.missing),
                else => unreachable,
            };
        }
        var results: [2]CommitResult = undefined;
        try world.exec_commit(process, slots, codes[0..slots.len], results[0..slots.len]);
    }

    fn exec_commit(world: *World, process: u32, slots: []const u32, codes: []const u8, results: []CommitResult) !void {
        assert(slots.len <= batch_max);
        const caller = world.caller_of(process);
        for (slots, codes, results) |slot_index, code, *result| result.* = world.model.commit(caller, slot_index, code);
        world.log.add("p{d}/h{d} commit slots {any} codes {any} -> {any}", .{ process, caller.holder.?, slots, codes, results });
        var real: [batch_max]CommitResult = undefined;
        world.processes[process].view.commit(slots, codes, real[0..slots.len]);
        for (results, 0..) |result, index| {
            try check("commit result", slots[index], @intFromEnum(result), @intFromEnum(real[index]));
        }
    }

    /// A commit the process is not entitled to (not its slot, or already final): refused.
    fn op_commit_invalid(world: *World) !void {
        const process = world.live_process().?;
        const slot_index = world.random.uintLessThan(u32, world.model.slot_count());
        const slot = world.model.slots[slot_index];
        if (slot.owner == world.processes[process].holder and slot.state == .idle) return; // valid
        var result: [1]CommitResult = undefined;
        try world.exec_commit(process, &.{slot_index}, &.{@intFromEnum(State.ready)}, &result);
        assert(result[0] != .ok);
    }

    fn op_wait(world: *World) !void {
        const process = world.process_holding(.waitable);
        var held: [slot_count_max]u32 = undefined;
        const found = world.held_slots(world.processes[process].holder, .waitable, &held);
        if (found == 0) return;
        const slots = world.pick_subset(held[0..found], 2);
        var results: [2]WaitResult = undefined;
        try world.exec_wait(process, slots, results[0..slots.len]);
    }

    /// Wait with timeout 0 (deterministic: the owner's liveness is judged at once).
    fn exec_wait(world: *World, process: u32, slots: []const u32, results: []WaitResult) !void {
        assert(slots.len <= batch_max);
        const caller = world.caller_of(process);
        for (slots, results) |slot_index, *result| result.* = world.model.wait(caller, slot_index);
        world.log.add("p{d}/h{d} wait slots {any} -> {any}", .{ process, caller.holder.?, slots, results });
        var real: [batch_max]WaitResult = undefined;
        world.processes[process].view.wait(slots, 0, real[0..slots.len]);
        for (results, 0..) |result, index| {
            world.stats.wait_results[@intFromEnum(result)] += 1;
            try check("wait result", slots[index], @intFromEnum(result), @intFromEnum(real[index]));
        }
    }

    fn op_release(world: *World) !void {
        const process = world.process_holding(.releasable);
        var held: [slot_count_max]u32 = undefined;
        const found = world.held_slots(world.processes[process].holder, .releasable, &held);
        if (found == 0) return;
        _ = try world.exec_release(process, world.pick_subset(held[0..found], batch_max));
    }

    fn exec_release(world: *World, process: u32, slots: []const u32) !u32 {
        const caller = world.caller_of(process);
        const expected = world.model.release(caller, slots);
        world.log.add("p{d}/h{d} release slots {any} -> {d}", .{ process, caller.holder.?, slots, expected });
        try check("released", 0, expected, world.processes[process].view.release(slots));
        return expected;
    }

    fn op_touch(world: *World) !void {
        var blocks: [batch_max]u32 = undefined;
        const n = world.random.intRangeAtMost(usize, 1, batch_max);
        for (blocks[0..n]) |*block| block.* = world.random_block();
        _ = try world.exec_touch(world.any_caller(), blocks[0..n]);
    }

    fn exec_touch(world: *World, who: Who, blocks: []const u32) !u64 {
        var ids: [batch_max]BlockId = undefined;
        for (blocks, 0..) |block, index| ids[index] = world.block_ids[block];
        const expected = world.model.touch(who.caller, blocks);
        world.log.add("pid {d} touch blocks {any} -> {d}", .{ who.caller.pid, blocks, expected });
        try check("touched", 0, expected, try who.view.touch(ids[0..blocks.len]));
        return expected;
    }

    fn op_prealloc(world: *World) !void {
        var keys: [batch_max]u32 = undefined;
        const n = world.random.intRangeAtMost(usize, 1, batch_max);
        world.random_keys(keys[0..n]);
        var results: [batch_max]PreallocResult = undefined;
        try world.exec_prealloc(world.any_caller(), keys[0..n], results[0..n]);
    }

    fn exec_prealloc(world: *World, who: Who, keys: []const u32, results: []PreallocResult) !void {
        var ids: [batch_max]BlockId = undefined;
        var shards: [batch_max]u32 = undefined;
        for (keys, 0..) |key, index| {
            ids[index] = world.block_ids[world.model.key_block(key)];
            shards[index] = world.model.key_shard(key);
        }
        const before = world.model.occupancy;
        world.model.prealloc(who.caller, keys, results);
        world.log.add("pid {d} prealloc keys {any} -> {any}", .{ who.caller.pid, keys, results });
        try world.check_guarantees(keys, before);
        var real: [batch_max]PreallocResult = undefined;
        who.view.prealloc(ids[0..keys.len], shards[0..keys.len], real[0..keys.len]);
        for (results, 0..) |result, index| {
            try check("prealloc result", index, @intFromEnum(result), @intFromEnum(real[index]));
        }
    }

    fn op_remove(world: *World) !void {
        var keys: [batch_max]u32 = undefined;
        const n = world.random.intRangeAtMost(usize, 1, batch_max);
        world.random_keys(keys[0..n]);
        const force = world.random.uintLessThan(u32, 3) == 0;
        _ = try world.exec_remove(world.any_caller(), keys[0..n], world.random.boolean(), force);
    }

    /// Removes the keys, or with `whole_blocks` every shard of their blocks.
    fn exec_remove(world: *World, who: Who, keys: []const u32, whole_blocks: bool, force: bool) !u64 {
        var blocks: [batch_max]u32 = undefined;
        var ids: [batch_max]BlockId = undefined;
        var shards: [batch_max]u32 = undefined;
        for (keys, 0..) |key, index| {
            blocks[index] = world.model.key_block(key);
            ids[index] = world.block_ids[blocks[index]];
            shards[index] = world.model.key_shard(key);
        }
        const n = keys.len;
        const shard_list: ?[]const u32 = if (whole_blocks) null else shards[0..n];
        const expected = world.model.remove(who.caller, blocks[0..n], shard_list, force);
        world.log.add("pid {d} remove blocks {any} shards {any} force {} -> {d}", .{ who.caller.pid, blocks[0..n], shard_list, force, expected });
        try check("removed", 0, expected, try who.view.remove(ids[0..n], shard_list, force));
        return expected;
    }

    fn op_lookup(world: *World) !void {
        var keys: [batch_max]u32 = undefined;
        const n = world.random.intRangeAtMost(usize, 1, batch_max);
        world.random_keys(keys[0..n]);
        var present: [batch_max]u8 = undefined;
        if (world.random.boolean()) {
            try world.exec_lookup(world.any_caller(), keys[0..n], present[0..n]);
        } else {
            var blocks: [batch_max]u32 = undefined;
            for (keys[0..n], 0..) |key, index| blocks[index] = world.model.key_block(key);
            const shards_per_block = world.random.intRangeAtMost(u32, 1, world.model.shards_per_block + 1);
            try world.exec_lookup_blocks(world.any_caller(), blocks[0..n], shards_per_block, present[0..n]);
        }
    }

    fn op_list_ready(world: *World) !void {
        const who = world.any_caller();
        const start = world.random.uintLessThan(u32, world.model.slot_count());
        const capacity = world.random.intRangeAtMost(usize, 1, batch_max);
        var cursor = start;
        var keys: [batch_max]u32 = undefined;
        const listed = world.model.list_ready(who.caller, &cursor, keys[0..capacity]);
        world.log.add("pid {d} list_ready from {d} up to {d} -> {any}, cursor {d}", .{ who.caller.pid, start, capacity, keys[0..listed], cursor });
        var real_cursor = start;
        var ids: [batch_max]BlockId = undefined;
        var shards: [batch_max]u32 = undefined;
        const real = try who.view.list_ready(&real_cursor, .{
            .block_ids = ids[0..capacity],
            .shard_indices = shards[0..capacity],
        });
        try check("list_ready count", 0, listed, real);
        try check("list_ready cursor", 0, cursor, real_cursor);
        for (keys[0..listed], 0..) |key, index| {
            try check("list_ready shard", index, world.model.key_shard(key), shards[index]);
            const id = &world.block_ids[world.model.key_block(key)];
            try check_true("list_ready block id", index, std.mem.eql(u8, id, &ids[index]));
        }
    }

    fn exec_lookup(world: *World, who: Who, keys: []const u32, present: []u8) !void {
        var ids: [batch_max]BlockId = undefined;
        var shards: [batch_max]u32 = undefined;
        for (keys, 0..) |key, index| {
            ids[index] = world.block_ids[world.model.key_block(key)];
            shards[index] = world.model.key_shard(key);
        }
        world.model.lookup(who.caller, keys, present);
        world.log.add("pid {d} lookup keys {any} -> {any}", .{ who.caller.pid, keys, present });
        var real: [batch_max]u8 = undefined;
        try who.view.lookup(ids[0..keys.len], shards[0..keys.len], real[0..keys.len]);
        for (present, 0..) |expected, index| try check("lookup", index, expected, real[index]);
    }

    fn exec_lookup_blocks(world: *World, who: Who, blocks: []const u32, shards_per_block: u32, present: []u8) !void {
        var ids: [batch_max]BlockId = undefined;
        for (blocks, 0..) |block, index| ids[index] = world.block_ids[block];
        world.model.lookup_blocks(who.caller, blocks, shards_per_block, present);
        world.log.add("pid {d} lookup_blocks {any} x {d} -> {any}", .{ who.caller.pid, blocks, shards_per_block, present });
        var real: [batch_max]u8 = undefined;
        try who.view.lookup_blocks(ids[0..blocks.len], shards_per_block, real[0..blocks.len]);
        for (present, 0..) |expected, index| try check("lookup_blocks", index, expected, real[index]);
    }

    fn op_take_dirty(world: *World) !void {
        const process = world.live_process().?;
        var claims: [batch_max]DirtyClaim = undefined;
        _ = try world.exec_take_dirty(process, claims[0..world.random.intRangeAtMost(usize, 1, batch_max)]);
    }

    /// Claims up to `claims.len` dirty slots as `process`, from its cursor.
    fn exec_take_dirty(world: *World, process: u32, claims: []DirtyClaim) !u32 {
        assert(claims.len <= batch_max);
        const caller = world.caller_of(process);
        var model_cursor = world.processes[process].take_cursor;
        const expected = world.model.take_dirty(caller, &model_cursor, claims);
        world.log.add("p{d}/h{d} take_dirty {d} -> {d} ({any}), cursor {d}", .{ process, caller.holder.?, claims.len, expected, claims[0..expected], model_cursor });
        var slots: [batch_max]u32 = undefined;
        var ids: [batch_max]BlockId = undefined;
        var shards: [batch_max]u32 = undefined;
        const n = claims.len;
        const taken = world.processes[process].view.take_dirty(&world.processes[process].take_cursor, .{
            .slots = slots[0..n],
            .block_ids = ids[0..n],
            .shard_indices = shards[0..n],
        });
        try check("take_dirty taken", 0, expected, taken);
        try check("take_dirty cursor", 0, model_cursor, world.processes[process].take_cursor);
        for (claims[0..expected], 0..) |claim, index| {
            try check("take_dirty slot", index, claim.slot, slots[index]);
            try check_true("take_dirty block id", index, std.mem.eql(u8, &ids[index], &world.block_ids[world.model.key_block(claim.key)]));
            try check("take_dirty shard", index, world.model.key_shard(claim.key), shards[index]);
        }
        return expected;
    }

    /// Ends a flush: clean some claimed slots (each written or not), then release them.
    fn op_clean(world: *World) !void {
        const process = world.process_holding(.claimed);
        var claimed: [slot_count_max]u32 = undefined;
        const found = world.held_slots(world.processes[process].holder, .claimed, &claimed);
        if (found == 0) return;
        const slots = world.pick_subset(claimed[0..found], batch_max);
        var written: [batch_max]u8 = undefined;
        for (written[0..slots.len]) |*ok| ok.* = @intFromBool(world.random.uintLessThan(u32, 4) != 0);
        _ = try world.exec_clean(process, slots, written[0..slots.len]);
        _ = try world.exec_release(process, slots);
    }

    fn exec_clean(world: *World, process: u32, slots: []const u32, written: []const u8) !u32 {
        const caller = world.caller_of(process);
        const expected = world.model.clean(caller, slots, written);
        world.log.add("p{d}/h{d} clean slots {any} written {any} -> {d}", .{ process, caller.holder.?, slots, written, expected });
        try check("cleaned", 0, expected, world.processes[process].view.clean(slots, written));
        return expected;
    }

    fn op_mark_closing(world: *World) !void {
        _ = try world.exec_mark_closing(world.live_process().?, world.random.uintLessThan(u32, 4) != 0);
    }

    fn exec_mark_closing(world: *World, process: u32, closing: bool) !bool {
        const caller = world.caller_of(process);
        const expected = world.model.mark_closing(caller, closing);
        world.log.add("p{d}/h{d} mark_closing {} -> last {}", .{ process, caller.holder.?, closing, expected });
        try check("mark_closing last", 0, @intFromBool(expected), @intFromBool(world.processes[process].view.mark_closing(closing)));
        return expected;
    }

    fn op_kill(world: *World) !void {
        world.exec_kill(world.live_process().?);
    }

    /// SIGKILL between two calls: whatever the process held stays, for others to find.
    fn exec_kill(world: *World, process: u32) void {
        assert(identities[process].alive);
        identities[process].alive = false;
        world.log.add("p{d}/h{d} killed", .{ process, world.processes[process].holder });
    }

    /// A dead process starts again: usually with its old pid (pid reuse: the old entry is
    /// found by pid and marked dead), else with a new one. A live process re-registering
    /// gets its own entry back.
    fn op_restart(world: *World) !void {
        if (world.pick_process(false)) |process| {
            const reuse = !world.processes[process].pid_retired and world.random.uintLessThan(u32, 3) != 0;
            try world.exec_restart(process, reuse);
        } else {
            const process = world.live_process().?;
            const holder = world.processes[process].holder;
            const cursor = world.processes[process].take_cursor;
            try world.register_process(process);
            try check("re-register is idempotent", process, holder, world.processes[process].holder);
            world.processes[process].take_cursor = cursor;
            world.log.add("p{d}/h{d} registered again", .{ process, holder });
        }
    }

    fn exec_restart(world: *World, process: u32, reuse_pid: bool) !void {
        assert(!identities[process].alive);
        assert(!reuse_pid or !world.processes[process].pid_retired);
        identities[process] = .{
            .pid = if (reuse_pid) identities[process].pid else world.fresh_pid(),
            .start_time = world.fresh_start_time(),
            .alive = true,
        };
        world.processes[process].pid_retired = false;
        try world.register_process(process);
        world.log.add("p{d} restarted: pid {d} (reused {}), holder {d}", .{ process, identities[process].pid, reuse_pid, world.processes[process].holder });
    }

    fn op_reclaim(world: *World) !void {
        _ = try world.exec_reclaim(world.any_caller());
    }

    fn exec_reclaim(world: *World, who: Who) !Reclaim {
        const expected = world.model.reclaim_dead(who.caller);
        world.log.add("pid {d} reclaim_dead -> {d} holders, {d} refs", .{ who.caller.pid, expected.holders, expected.refs });
        const real = try who.view.reclaim_dead();
        try check("reclaim holders", 0, expected.holders, real.holders);
        try check("reclaim refs", 0, expected.refs, real.refs);
        return expected;
    }

    fn op_lock_death(world: *World) !void {
        const bucket = world.random.uintLessThan(u32, world.base.geometry.bucket_count);
        try world.exec_lock_death(world.live_process().?, bucket);
    }

    /// SIGKILL inside a bucket's critical section: the lock word keeps the dead pid until
    /// someone who needs the bucket steals it (after a 10 ms lock slice).
    fn exec_lock_death(world: *World, process: u32, bucket: u32) !void {
        const caller = world.caller_of(process);
        world.model.hold_lock(caller, bucket);
        try world.processes[process].view.debug_hold_lock(bucket);
        // Now and then it dies between a slot's namespace field and the counter (either side).
        if (world.random.boolean()) world.inject_namespace_drift(bucket);
        identities[process].alive = false;
        world.processes[process].pid_retired = true;
        world.log.add("p{d}/h{d} killed holding bucket {d}'s lock", .{ process, caller.holder.?, bucket });
    }

    /// No insert pushed another namespace below its guarantee: every namespace none of `keys`
    /// belongs to holds at least min(what it held before, its guarantee).
    fn check_guarantees(world: *World, keys: []const u32, before: [namespace_count_max + 1]u32) !void {
        const model = &world.model;
        if (model.drift) return;
        for (0..model.namespace_count) |index| {
            var inserting = false;
            for (keys) |key| inserting = inserting or model.namespace_of(key) == index;
            if (inserting) continue;
            const floor = @min(before[index], model.guarantees[index]);
            try check_true("namespace guarantee holds", index, model.occupancy[index] >= floor);
        }
    }

    /// A kill inside a namespace update of a slot of `bucket`: the field cleared without the
    /// counter (counter one too high), or the counter decremented without the field (one too
    /// low). Only `reclaim_dead`'s recount repairs it.
    fn inject_namespace_drift(world: *World, bucket: u32) void {
        const model = &world.model;
        for (model.slots[0..model.slot_count()], 0..) |*slot, index| {
            if (slot.place != .linked or slot.namespace == 0) continue;
            if (model.key_bucket(slot.key) != bucket) continue;
            const counter = &world.base.namespace_table.entries[slot.namespace - 1].occupancy_slots;
            if (world.random.boolean()) {
                slot.namespace = 0;
                world.base.slots[index].namespace.store(0, .monotonic);
            } else if (model.occupancy[slot.namespace - 1] > 0) {
                model.occupancy[slot.namespace - 1] -= 1;
                _ = counter.fetchSub(1, .monotonic);
            }
            model.drift = true;
            model.drifted = true;
            world.log.add("  drift injected at slot {d}", .{index});
            return;
        }
    }

    /// Prints every slot as the model and the buffer see it.
    fn dump_slots(world: *const World) void {
        const model = &world.model;
        std.debug.print("slots (model | buffer): place/bucket key state accessed owner+1 holders flusher+1 flags\n", .{});
        for (0..model.slot_count()) |index| {
            const slot = model.slots[index];
            const real = &world.base.slots[index];
            std.debug.print("  {d:>2}: {s:>8} k{d:<2} {s:>7} a{d} o{d} h{x} f{d} {s}{s} | b{d} s{d} {d} a{d} o{d} h{x} f{d} flags {x}\n", .{
                index,                         @tagName(slot.place),
                slot.key,                      @tagName(slot.state),
                @intFromBool(slot.accessed),   if (slot.owner) |owner| owner + 1 else 0,
                slot.holders,                  if (slot.flusher) |flusher| flusher + 1 else 0,
                if (slot.dirty) "D" else "-",  if (slot.preallocated) "P" else "-",
                real.bucket.load(.monotonic),  real.shard_index,
                real.state.load(.monotonic),   real.accessed.load(.monotonic),
                real.owner.load(.monotonic),   real.holders.load(.monotonic),
                real.flusher.load(.monotonic), real.flags.load(.monotonic),
            });
        }
        std.debug.print("  cursors (model | buffer): {d} {d} | {d} {d}; fresh {d} {d} | {d} {d}; dead mask {x}\n", .{
            model.cursor[0],                                  model.cursor[1],
            world.base.clock.cursor_regular.load(.monotonic), world.base.clock.cursor_reserved.load(.monotonic),
            model.fresh[0],                                   model.fresh[1],
            world.base.clock.fresh_regular.load(.monotonic),  world.base.clock.fresh_reserved.load(.monotonic),
            model.dead_mask(),
        });
    }

    /// Compares the whole control region with the model.
    fn check_state(world: *World) !void {
        const model = &world.model;
        const buffer = world.base;
        const total = model.slot_count();
        try check("slot count", 0, total, buffer.slots.len);
        // The chains, as sets: each bucket's chain holds exactly the slots linked for keys
        // of that bucket.
        var on_chain: [slot_count_max]bool = @splat(false);
        for (buffer.buckets, 0..) |*bucket, bucket_index| {
            // The pid in the lock word (a stolen lock keeps the contended bit until released).
            const lock_pid_mask: u32 = (1 << 31) - 1;
            try check("bucket lock holder", bucket_index, model.dead_locks[bucket_index], bucket.lock.load(.monotonic) & lock_pid_mask);
            var current = bucket.head;
            var steps: u32 = 0;
            while (current != slot_none) : (steps += 1) {
                try check_true("chain is bounded", bucket_index, steps < total and current < total);
                try check_true("slot on one chain", current, !on_chain[current]);
                on_chain[current] = true;
                const slot = model.slots[current];
                try check_true("chained slot is linked", current, slot.place == .linked);
                try check("chained slot's bucket", current, model.key_bucket(slot.key), bucket_index);
                current = buffer.slots[current].next;
            }
        }
        for (0..total) |index| {
            const slot = model.slots[index];
            const real = &buffer.slots[index];
            const bucket_word: u32 = switch (slot.place) {
                .free => buffer_module.bucket_free,
                .detached => buffer_module.bucket_detached,
                .linked => model.key_bucket(slot.key),
            };
            try check("slot bucket", index, bucket_word, real.bucket.load(.monotonic));
            try check("slot on its chain", index, @intFromBool(slot.place == .linked), @intFromBool(on_chain[index]));
            if (slot.place != .linked) try check("unlinked slot's next", index, slot_none, real.next);
            if (slot.place == .free) {
                try check_true("free slot's block id", index, std.mem.allEqual(u8, &real.block_id, 0));
                try check("free slot's shard", index, 0, real.shard_index);
            } else {
                try check_true("slot block id", index, std.mem.eql(u8, &real.block_id, &world.block_ids[model.key_block(slot.key)]));
                try check("slot shard", index, model.key_shard(slot.key), real.shard_index);
            }
            try check("slot state", index, @intFromEnum(slot.state), real.state.load(.monotonic));
            try check("slot accessed bit", index, @intFromBool(slot.accessed), real.accessed.load(.monotonic));
            try check("slot owner", index, if (slot.owner) |owner| owner + 1 else 0, real.owner.load(.monotonic));
            try check("slot holders", index, slot.holders, real.holders.load(.monotonic));
            try check("slot flusher", index, if (slot.flusher) |flusher| flusher + 1 else 0, real.flusher.load(.monotonic));
            try check("slot version", index, slot.version, real.version.load(.monotonic));
            try check("slot reuses", index, slot.reuses, real.reuses.load(.monotonic));
            var flags: u32 = 0;
            if (index >= model.slot_count_regular) flags |= buffer_module.slot_flag_reserved;
            if (slot.preallocated) flags |= buffer_module.slot_flag_preallocated;
            if (slot.dirty) flags |= buffer_module.slot_flag_dirty;
            try check("slot flags", index, flags, real.flags.load(.monotonic));
            try check("slot namespace", index, slot.namespace, real.namespace.load(.monotonic));
        }
        // Namespaces: the model's counters are the buffer's; without injected drift they are
        // exact (each counts exactly the linked slots of its keys, every other slot counts
        // nowhere), and no namespace holds more than its cap.
        for (0..constants.buffer_namespaces_max) |index| {
            const expected: u32 = if (index < model.namespace_count) model.occupancy[index] else 0;
            try check("namespace occupancy", index, expected, buffer.namespace_occupancy(@intCast(index)));
            const entry = &buffer.namespace_table.entries[index];
            const used = index < model.namespace_count;
            try check("namespace hits", index, if (used) model.namespace_hits[index] else 0, entry.hits.load(.monotonic));
            try check("namespace misses", index, if (used) model.namespace_misses[index] else 0, entry.misses.load(.monotonic));
            try check("namespace evictions", index, if (used) model.namespace_evictions[index] else 0, entry.evictions.load(.monotonic));
        }
        // Every Get hit, miss and eviction is some namespace's, exactly once.
        var sums: [3]u64 = @splat(0);
        for (0..model.namespace_count) |index| {
            sums[0] += model.namespace_hits[index];
            sums[1] += model.namespace_misses[index];
            sums[2] += model.namespace_evictions[index];
        }
        try check("namespace hits add up", 0, model.counters[@intFromEnum(Counter.hits)], sums[0]);
        try check("namespace misses add up", 0, model.counters[@intFromEnum(Counter.misses)], sums[1]);
        try check("namespace evictions add up", 0, model.counters[@intFromEnum(Counter.evictions)], sums[2]);
        if (!model.drift) {
            var exact: [namespace_count_max + 1]u32 = @splat(0);
            for (model.slots[0..total], 0..) |slot, index| {
                const field: u16 = if (slot.place == .linked) model.namespace_of(slot.key) + 1 else 0;
                try check("namespace field exact", index, field, slot.namespace);
                if (field != 0) exact[field - 1] += 1;
            }
            for (exact, model.occupancy, model.caps, 0..) |count, occupancy, cap, index| {
                try check("namespace counter exact", index, count, occupancy);
                try check_true("namespace within its cap", index, model.drifted or occupancy <= cap);
            }
        }
        try check("fresh regular", 0, model.fresh[0], buffer.clock.fresh_regular.load(.monotonic));
        try check("fresh reserved", 0, model.fresh[1], buffer.clock.fresh_reserved.load(.monotonic));
        try check("cursor regular", 0, model.cursor[0], buffer.clock.cursor_regular.load(.monotonic));
        try check("cursor reserved", 0, model.cursor[1], buffer.clock.cursor_reserved.load(.monotonic));
        const table = buffer.holder_table;
        try check("dead mask", 0, model.dead_mask(), table.dead_mask.load(.monotonic));
        for (model.entries, 0..) |entry, index| {
            const real = &table.entries[index];
            try check("holder entry tag", index, buffer_module.holder_tag(entry.state, entry.pid), real.tag.load(.monotonic));
            try check("holder entry reclaimer", index, 0, real.reclaimer.load(.monotonic));
            if (entry.state == .free) continue;
            try check("holder entry start time", index, entry.start_time, real.start_time.load(.monotonic));
            try check("holder entry closing", index, @intFromBool(entry.closing), real.closing.load(.monotonic));
        }
        for (model.counters, 0..) |expected, index| {
            const actual = buffer.counter_value(@enumFromInt(index));
            if (expected != actual) {
                std.debug.print("buffer fuzz mismatch: counter {s}: model {d}, buffer {d}\n", .{ buffer_module.counter_names[index], expected, actual });
                return error.ModelMismatch;
            }
        }
        // Model invariants (the model's own consistency, independent of the buffer).
        var dirty: u64 = 0;
        for (model.slots[0..total], 0..) |slot, index| {
            dirty += @intFromBool(slot.dirty);
            if (slot.place == .linked) assert(model.resident[slot.key].? == index);
            if (slot.place == .free) assert(slot.holders == 0 and !slot.dirty);
            if (slot.place == .linked and slot.flusher != null) assert(slot.dirty);
            if (slot.state == .failed or slot.state == .missing) assert(slot.place != .linked);
        }
        assert(dirty == model.counters[@intFromEnum(Counter.dirty_slots)]);
        model.check_dead_mask();
    }

    /// The end of an epoch: the survivors finish their work, the dead are reclaimed, every
    /// survivor closes, and the last one pays the whole write-back debt: nothing acknowledged
    /// (committed dirty) is left unwritten, and nothing is left referenced.
    fn finish(world: *World) !void {
        if (world.live_process() == null) try world.op_restart();
        for (0..world.process_count) |index| {
            const process: u32 = @intCast(index);
            if (!identities[process].alive) continue;
            const holder = world.processes[process].holder;
            var held: [slot_count_max]u32 = undefined;
            const claimed = world.held_slots(holder, .claimed, &held);
            const written: [slot_count_max]u8 = @splat(1);
            if (claimed > 0) _ = try world.exec_clean(process, held[0..claimed], written[0..claimed]);
            _ = try world.exec_release(process, held[0..world.held_slots(holder, .any, &held)]);
        }
        try world.check_state();
        _ = try world.exec_reclaim(base_who(world));
        try world.check_state();
        var last: ?u32 = null;
        for (0..world.process_count) |index| {
            const process: u32 = @intCast(index);
            if (!identities[process].alive) continue;
            if (try world.exec_mark_closing(process, true)) last = process;
        }
        try check_true("finish: a survivor is the last to close", 0, last != null);
        var rounds: u32 = 0;
        while (world.model.counters[@intFromEnum(Counter.dirty_slots)] > 0) : (rounds += 1) {
            try check_true("finish: the debt is paid in bounded rounds", rounds, rounds <= slot_count_max);
            var claims: [batch_max]DirtyClaim = undefined;
            const taken = try world.exec_take_dirty(last.?, &claims);
            try check_true("finish: the last to close can claim the debt", rounds, taken > 0);
            var slots: [batch_max]u32 = undefined;
            for (claims[0..taken], 0..) |claim, index| slots[index] = claim.slot;
            const written: [batch_max]u8 = @splat(1);
            try check("finish: cleaned", rounds, taken, try world.exec_clean(last.?, slots[0..taken], written[0..taken]));
            _ = try world.exec_release(last.?, slots[0..taken]);
        }
        try world.check_state();
        for (world.base.slots, 0..) |*slot, index| {
            try check("finish: no reference left", index, 0, slot.holders.load(.monotonic));
            try check("finish: no debt left", index, 0, slot.flags.load(.monotonic) & buffer_module.slot_flag_dirty);
        }
        try check("finish: dirty gauge", 0, 0, world.base.counter_value(.dirty_slots));
    }
};

pub const Summary = struct {
    steps: u64 = 0,
    epochs: u64 = 0,
    /// The buffer's counters summed over the epochs: the events whose outcome the model
    /// predicted (the coverage of a run).
    counters: [counter_count]u64 = @splat(0),
    /// Operations run, by kind.
    ops: [op_count]u64 = @splat(0),
    /// Get outcomes, by result.
    get_results: [@typeInfo(GetResult).@"enum".fields.len]u64 = @splat(0),
    /// Wait outcomes, by result.
    wait_results: [@typeInfo(WaitResult).@"enum".fields.len]u64 = @splat(0),
    /// Registrations into a full holder table (which reclaims the dead first).
    full_table_registrations: u64 = 0,
    /// Namespaces: recounts that repaired an injected kill between a slot's field and its
    /// counter, victims passed over to keep a guarantee, allocations at a namespace's cap.
    drifts_repaired: u64 = 0,
    guarantee_refusals: u64 = 0,
    allocations_at_cap: u64 = 0,
};

/// Runs `steps` fuzz steps from `seed` (epochs of `epoch_steps`). On a mismatch prints the
/// seed, the step and the last operations, and returns error.ModelMismatch.
pub fn run(seed: u64, steps: u64) !Summary {
    assert(!running);
    running = true;
    defer running = false;
    buffer_module.debug_identity_alive = identity_alive;
    defer buffer_module.debug_identity_alive = null;
    var prng = std.Random.DefaultPrng.init(seed);
    var summary = Summary{};
    var world: World = undefined;
    var done: u64 = 0;
    while (done < steps) : (summary.epochs += 1) {
        const epoch_end = @min(steps, done + epoch_steps);
        try world.init(prng.random(), &summary);
        world.check_state() catch |err| return report_failure(seed, steps, done, summary.epochs, &world, err);
        while (done < epoch_end) : (done += 1) {
            world.step() catch |err| return report_failure(seed, steps, done, summary.epochs, &world, err);
            world.check_state() catch |err| return report_failure(seed, steps, done, summary.epochs, &world, err);
        }
        world.finish() catch |err| return report_failure(seed, steps, done, summary.epochs, &world, err);
        for (&summary.counters, world.model.counters) |*total, value| total.* += value;
        summary.full_table_registrations += world.model.full_table_registrations;
        summary.drifts_repaired += world.model.drifts_repaired;
        summary.guarantee_refusals += world.model.guarantee_refusals;
        summary.allocations_at_cap += world.model.allocations_at_cap;
    }
    summary.steps = done;
    return summary;
}

fn report_failure(seed: u64, steps: u64, step_index: u64, epoch: u64, world: *const World, err: anyerror) anyerror {
    std.debug.print("buffer fuzz failed at step {d} (epoch {d}: {s}): {s}; last operations:\n", .{
        step_index,
        epoch,
        world.description[0..world.description_len],
        @errorName(err),
    });
    world.log.dump();
    world.dump_slots();
    std.debug.print("buffer fuzz failed: seed {d}, steps {d}; reproduce: zig build fuzz -- buffer --seed {d} --steps {d}\n", .{ seed, steps, seed, steps });
    return err;
}

/// Prints how often each counted event happened in a run (what the model predicted).
pub fn print_coverage(summary: *const Summary) void {
    std.debug.print("  operations:", .{});
    for (summary.ops, 0..) |value, index| std.debug.print(" {s} {d}", .{ @tagName(@as(Op, @enumFromInt(index))), value });
    std.debug.print("\n  get results:", .{});
    for (summary.get_results, 0..) |value, index| std.debug.print(" {s} {d}", .{ @tagName(@as(GetResult, @enumFromInt(index))), value });
    std.debug.print("\n  wait results:", .{});
    for (summary.wait_results, 0..) |value, index| std.debug.print(" {s} {d}", .{ @tagName(@as(WaitResult, @enumFromInt(index))), value });
    std.debug.print("\n  registrations into a full holder table: {d}", .{summary.full_table_registrations});
    std.debug.print("\n  namespaces: drifts repaired {d}, guarantee refusals {d}, allocations at a cap {d}", .{
        summary.drifts_repaired, summary.guarantee_refusals, summary.allocations_at_cap,
    });
    std.debug.print("\n  counters:", .{});
    for (summary.counters, 0..) |value, index| std.debug.print(" {s} {d}", .{ buffer_module.counter_names[index], value });
    std.debug.print("\n", .{});
}

/// The seed for a fresh run: `UCM_FUZZ_SEED` when set (a failure found elsewhere), else random.
pub fn fresh_seed() !u64 {
    if (std.posix.getenv("UCM_FUZZ_SEED")) |text| {
        return std.fmt.parseInt(u64, text, 10) catch {
            std.debug.print("UCM_FUZZ_SEED={s} is not a seed: expected an unsigned 64-bit decimal integer\n", .{text});
            return error.InvalidSeed;
        };
    }
    return std.crypto.random.int(u64);
}

test "buffer fuzz: model-based, fixed seeds" {
    const seeds = [_]u64{ 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233 };
    var drifts_repaired: u64 = 0;
    var guarantee_refusals: u64 = 0;
    var allocations_at_cap: u64 = 0;
    for (seeds) |seed| {
        const summary = try run(seed, fixed_seed_steps);
        drifts_repaired += summary.drifts_repaired;
        guarantee_refusals += summary.guarantee_refusals;
        allocations_at_cap += summary.allocations_at_cap;
    }
    // The fixed seeds reach every namespace path: the recount's repair, the guarantee, the cap.
    try expect(drifts_repaired > 0 and guarantee_refusals > 0 and allocations_at_cap > 0);
}

const fixed_seed_steps = 4 * epoch_steps;
const fresh_seed_steps = 10 * epoch_steps;

test "buffer fuzz: one fresh seed (UCM_FUZZ_SEED, else random)" {
    const seed = try fresh_seed();
    std.debug.print("buffer fuzz: seed {d}, steps {d}\n", .{ seed, fresh_seed_steps });
    _ = try run(seed, fresh_seed_steps);
}

// -------------------------------------------------------------------------------------------
// Directed runs through the same harness: the seed's scenarios, and regressions the fuzzer
// found. Every step is also checked against the model.

/// Runs `body` on a fresh world of `config`, then the end-of-epoch checks.
fn run_scripted(config: Config, body: *const fn (*World) anyerror!void) !void {
    assert(!running);
    running = true;
    defer running = false;
    buffer_module.debug_identity_alive = identity_alive;
    defer buffer_module.debug_identity_alive = null;
    var prng = std.Random.DefaultPrng.init(1);
    var stats = Summary{};
    var world: World = undefined;
    try world.init_config(config, prng.random(), &stats);
    try world.check_state();
    body(&world) catch |err| {
        std.debug.print("scripted run failed: {s}; last operations:\n", .{@errorName(err)});
        world.log.dump();
        world.dump_slots();
        return err;
    };
    try world.check_state();
    try world.finish();
}

fn scripted_config(regular: u32, reserved: u32, blocks: u32, shards_per_block: u32, processes: u32) Config {
    return .{
        .geometry = .{
            .shard_size_bytes = 64,
            .slot_count_regular = regular,
            .slot_count_reserved = reserved,
            .bucket_count = 1,
            .slots_per_segment = regular + reserved,
        },
        .block_count = blocks,
        .shards_per_block = shards_per_block,
        .process_count = processes,
    };
}

/// Gets `keys` as `process`, checks the state, and expects `expected` results in `slots`.
fn get_expect(world: *World, process: u32, keys: []const u32, expected: []const GetResult, slots: []const u32) !void {
    var results: [batch_max]GetResult = undefined;
    var got: [batch_max]u32 = undefined;
    try world.exec_get(process, .claim, keys, results[0..keys.len], got[0..keys.len]);
    try world.check_state();
    try std.testing.expectEqualSlices(GetResult, expected, results[0..keys.len]);
    try std.testing.expectEqualSlices(u32, slots, got[0..keys.len]);
}

fn commit_ready(world: *World, process: u32, slots: []const u32) !void {
    var codes: [batch_max]u8 = undefined;
    @memset(codes[0..slots.len], @intFromEnum(State.ready));
    var results: [batch_max]CommitResult = undefined;
    try world.exec_commit(process, slots, codes[0..slots.len], results[0..slots.len]);
    try world.check_state();
    for (results[0..slots.len]) |result| try expectEqual(CommitResult.ok, result);
}

fn release_expect(world: *World, process: u32, slots: []const u32) !void {
    try expectEqual(@as(u32, @intCast(slots.len)), try world.exec_release(process, slots));
    try world.check_state();
}

fn base_who(world: *const World) Who {
    return .{ .view = world.base, .caller = world.base_caller() };
}

fn accessed_bits(world: *const World) u32 {
    var bits: u32 = 0;
    for (world.base.slots, 0..) |*slot, index| {
        if (slot.accessed.load(.monotonic) != 0) bits |= @as(u32, 1) << @intCast(index);
    }
    return bits;
}

test "buffer fuzz, scripted: Scenario C, CLOCK keeps a hit shard and evicts the untouched one" {
    // 4 slots; blocks A B C D E F (one shard each) are keys 0..5.
    try run_scripted(scripted_config(4, 0, 6, 1, 1), &struct {
        fn body(world: *World) !void {
            try get_expect(world, 0, &.{ 0, 1, 2 }, &.{ .owner, .owner, .owner }, &.{ 0, 1, 2 });
            try get_expect(world, 0, &.{3}, &.{.owner}, &.{3});
            try commit_ready(world, 0, &.{ 0, 1, 2 });
            try commit_ready(world, 0, &.{3});
            try release_expect(world, 0, &.{ 0, 1, 2 });
            try release_expect(world, 0, &.{3});
            try expectEqual(@as(u32, 0b1111), accessed_bits(world)); // set on new load
            // Miss E: a lap clears every bit, the raw cursor takes slot 0 (A).
            try get_expect(world, 0, &.{4}, &.{.owner}, &.{0});
            try expectEqual(@as(u32, 0b0001), accessed_bits(world));
            try expectEqual(@as(u32, 1), world.base.cursor_position(.regular));
            try commit_ready(world, 0, &.{0});
            try release_expect(world, 0, &.{0});
            // A hit on B sets its bit again.
            try get_expect(world, 0, &.{1}, &.{.hit}, &.{1});
            try release_expect(world, 0, &.{1});
            try expectEqual(@as(u32, 0b0011), accessed_bits(world));
            // Miss F: B gets its second chance, C (bit 0) is the victim.
            try get_expect(world, 0, &.{5}, &.{.owner}, &.{2});
            try expectEqual(@as(u64, 2), world.base.counter_value(.evictions));
            var present: [2]u8 = undefined;
            try world.exec_lookup(base_who(world), &.{ 1, 2 }, &present);
            try std.testing.expectEqualSlices(u8, &.{ 1, 0 }, &present); // B stays, C left
            try release_expect(world, 0, &.{2});
        }
    }.body);
}

test "buffer fuzz, scripted: Scenario D, Touch renews every shard of a block" {
    // 6 slots; block T (0) has shards 0..2 (keys 0..2); U V W Y X are blocks 1..5, shard 0.
    try run_scripted(scripted_config(6, 0, 6, 3, 1), &struct {
        fn body(world: *World) !void {
            const u = 3;
            const v = 6;
            const w = 9;
            const y = 12;
            const x = 15;
            try get_expect(world, 0, &.{ 0, 1, 2 }, &.{ .owner, .owner, .owner }, &.{ 0, 1, 2 });
            try get_expect(world, 0, &.{ u, v, w }, &.{ .owner, .owner, .owner }, &.{ 3, 4, 5 });
            try commit_ready(world, 0, &.{ 0, 1, 2 });
            try commit_ready(world, 0, &.{ 3, 4, 5 });
            // One miss sweeps the new-load bits: only W is free to go, so Y replaces it.
            try release_expect(world, 0, &.{5});
            try get_expect(world, 0, &.{y}, &.{.owner}, &.{5});
            try commit_ready(world, 0, &.{5});
            try release_expect(world, 0, &.{ 0, 1, 2 });
            try release_expect(world, 0, &.{ 3, 4, 5 });
            try expectEqual(@as(u32, 0b100000), accessed_bits(world));
            try expectEqual(@as(u32, 0), world.base.cursor_position(.regular));
            // Touch T: its three resident shards get their bits back.
            try expectEqual(@as(u64, 3), try world.exec_touch(base_who(world), &.{0}));
            try world.check_state();
            try expectEqual(@as(u32, 0b100111), accessed_bits(world));
            // Miss X: T's shards get second chances; U (slot 3) is the victim.
            try get_expect(world, 0, &.{x}, &.{.owner}, &.{3});
            var present: [1]u8 = undefined;
            try world.exec_lookup_blocks(base_who(world), &.{0}, 3, &present);
            try expectEqual(@as(u8, 1), present[0]);
            try release_expect(world, 0, &.{3});
        }
    }.body);
}

test "buffer fuzz, scripted: Scenario E, Prealloc prewarms next shards in the reserved pool" {
    // 3 regular + 3 reserved slots; blocks B0..B3 with shards s=0 and s+1=1: key = 2 * block + shard.
    try run_scripted(scripted_config(3, 3, 4, 2, 2), &struct {
        fn body(world: *World) !void {
            try get_expect(world, 0, &.{ 0, 2, 4 }, &.{ .owner, .owner, .owner }, &.{ 0, 1, 2 });
            try commit_ready(world, 0, &.{ 0, 1, 2 });
            // The idle window: prewarm (B0, s+1), (B1, s+1), (B2, s+1); the regular pool is full.
            var results: [3]PreallocResult = undefined;
            try world.exec_prealloc(base_who(world), &.{ 1, 3, 5 }, &results);
            try world.check_state();
            try std.testing.expectEqualSlices(PreallocResult, &.{ .allocated, .allocated, .allocated }, &results);
            for (world.base.slots[3..6]) |*slot| {
                try expectEqual(buffer_module.slot_flag_reserved | buffer_module.slot_flag_preallocated, slot.flags.load(.monotonic));
                try expectEqual(@as(u32, 0), slot.refcount());
            }
            try release_expect(world, 0, &.{ 0, 1, 2 });
            // The next task: (B0, s+1) is found on its chain, idle with refcount 0: owner at once,
            // no victim search (the cursor has not moved, nothing was evicted).
            try get_expect(world, 0, &.{1}, &.{.owner}, &.{3});
            try get_expect(world, 1, &.{3}, &.{.owner}, &.{4});
            try expectEqual(@as(u64, 2), world.base.counter_value(.prealloc_hits));
            try expectEqual(@as(u32, 0), world.base.cursor_position(.regular));
            try expectEqual(@as(u64, 0), world.base.counter_value(.evictions));
            // Taken by someone else already: a waiter, through the same fast path.
            try get_expect(world, 0, &.{3}, &.{.waiter}, &.{4});
            try commit_ready(world, 0, &.{3});
            try commit_ready(world, 1, &.{4});
            try release_expect(world, 0, &.{ 3, 4 });
            try release_expect(world, 1, &.{4});
        }
    }.body);
}

test "buffer fuzz, regression: a force-removed Idle slot given up by its owner is taken over" {
    // Found by the fuzzer: `release` cleared the owner of an Idle slot on a chain but not of a
    // detached one, so its waiters waited on an owner that had left (until their timeout).
    try run_scripted(scripted_config(2, 0, 1, 1, 2), &struct {
        fn body(world: *World) !void {
            try get_expect(world, 0, &.{0}, &.{.owner}, &.{0});
            try get_expect(world, 1, &.{0}, &.{.waiter}, &.{0});
            const base = base_who(world);
            try expectEqual(@as(u64, 0), try world.exec_remove(base, &.{0}, false, true));
            try expectEqual(buffer_module.bucket_detached, world.base.slots[0].bucket.load(.monotonic));
            try release_expect(world, 0, &.{0}); // the owner gives up
            try expectEqual(@as(u32, 0), world.base.slots[0].owner.load(.monotonic));
            var waited: [1]WaitResult = undefined;
            try world.exec_wait(1, &.{0}, &waited);
            try expectEqual(WaitResult.takeover, waited[0]);
            try commit_ready(world, 1, &.{0});
            try release_expect(world, 1, &.{0});
            try expectEqual(buffer_module.bucket_free, world.base.slots[0].bucket.load(.monotonic));
        }
    }.body);
}

test "buffer fuzz, regression: reclaim_dead clears a dead owner of a detached slot" {
    // Found by the fuzzer: the sweep of a detached slot dropped the dead owner's reference but
    // kept its owner word; a new process registering into the freed entry was then taken for
    // the owner, and the waiter never took over.
    try run_scripted(scripted_config(2, 0, 1, 1, 2), &struct {
        fn body(world: *World) !void {
            try expectEqual(@as(u32, 0), world.processes[0].holder);
            try get_expect(world, 0, &.{0}, &.{.owner}, &.{0});
            try get_expect(world, 1, &.{0}, &.{.waiter}, &.{0});
            const base = base_who(world);
            _ = try world.exec_remove(base, &.{0}, false, true);
            world.exec_kill(0);
            const report = try world.exec_reclaim(base);
            try world.check_state();
            try expectEqual(Reclaim{ .holders = 1, .refs = 1 }, report);
            try expectEqual(@as(u32, 0), world.base.slots[0].owner.load(.monotonic));
            try world.exec_restart(0, false);
            try world.check_state();
            try expectEqual(@as(u32, 0), world.processes[0].holder); // the freed entry, reused
            var waited: [1]WaitResult = undefined;
            try world.exec_wait(1, &.{0}, &waited);
            try expectEqual(WaitResult.takeover, waited[0]);
            try release_expect(world, 1, &.{0});
        }
    }.body);
}

// -------------------------------------------------------------------------------------------
// Holder table tests.

fn test_block_id(block: u8) BlockId {
    var id: BlockId = @splat(0);
    id[0] = block + 1;
    id[15] = 0xB0;
    return id;
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
    view.get(&.{test_block_id(0)}, &.{0}, .{ .results = &result, .slots = &slot });
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

test "admission: hits, waiters and held Gets count uses; admit claims each tier's bit once" {
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
    var a = base;
    a.pid = buffer_module.current_pid();
    a.holder = 0;
    var b = a;
    b.holder = 1;
    const id = [_]BlockId{test_block_id(0)};
    const shard = [_]u32{0};
    var result: [1]buffer_module.GetResult = undefined;
    var slot: [1]u32 = undefined;
    a.get(&id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.owner, result[0]);
    const index = slot[0];
    const target = &base.slots[index];
    // B waits on A's fill: a use. The owner's own Get installed the slot: none.
    b.get(&id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.waiter, result[0]);
    try expectEqual(@as(u16, 1), target.reuses.load(.monotonic));
    var committed: [1]buffer_module.CommitResult = undefined;
    a.commit(&.{index}, &.{@intFromEnum(buffer_module.State.ready)}, &committed);
    try expectEqual(buffer_module.CommitResult.ok, committed[0]);
    _ = a.release(&.{index});
    // B asks again while holding it (held), A hits: two uses. A look-up is none.
    b.get(&id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.held, result[0]);
    a.get(&id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.hit, result[0]);
    var present: [1]u8 = undefined;
    try a.lookup(&id, &shard, &present);
    var uses: [1]u16 = undefined;
    try a.reuses(&id, &shard, &uses);
    try expectEqual(@as(u16, 3), uses[0]);
    // A dump's claims (a hit, then held) write the block: no use.
    var c = a;
    c.holder = 2;
    c.get_as(.write, &id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.hit, result[0]);
    c.get_as(.write, &id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.held, result[0]);
    _ = c.release(&.{index});
    try a.reuses(&id, &shard, &uses);
    try expectEqual(@as(u16, 3), uses[0]);
    // A holds it: not admitted (next use); B does not hold it once released.
    _ = b.release(&.{index});
    var admitted: [1]u32 = undefined;
    const rule: Buffer.AdmitRule = .{ .reuses_min = 3, .tier = 0, .mature = false, .needs_mature = false };
    try expectEqual(@as(u32, 0), a.admit(&id, &shard, rule, &admitted));
    try expectEqual(@as(u32, 0), a.admit(&id, &shard, .{ .reuses_min = 4, .tier = 0, .mature = false, .needs_mature = false }, &admitted));
    try expectEqual(@as(u32, 1), b.admit(&id, &shard, rule, &admitted));
    try expectEqual(index, admitted[0]);
    try expectEqual(@as(u64, 0b11), target.holders.load(.monotonic)); // B's claim reference
    try expectEqual(@as(u32, 0), b.admit(&id, &shard, rule, &admitted)); // tier 0: once
    // A write to the tier that failed gives the bit back while B still holds the slot: the
    // next check after the release admits it again (and only then, and once).
    try expectEqual(@as(u32, 1), b.unadmit(&.{index}, 0));
    try expectEqual(@as(u32, 0), b.unadmit(&.{index}, 0)); // cleared already
    try expectEqual(@as(u32, 0), b.unadmit(&.{index}, 1)); // another tier's bit: not set
    _ = b.release(&.{index});
    try expectEqual(@as(u32, 1), b.admit(&id, &shard, rule, &admitted));
    try expectEqual(index, admitted[0]);
    _ = b.release(&.{index});
    try expectEqual(@as(u32, 0), b.admit(&id, &shard, rule, &admitted));
    // Tier 1 with a minimum residency: only once matured; `admit` itself counts no use.
    const residency: Buffer.AdmitRule = .{ .reuses_min = 0, .tier = 1, .mature = false, .needs_mature = true };
    try expectEqual(@as(u32, 0), b.admit(&id, &shard, residency, &admitted));
    var matured = residency;
    matured.mature = true;
    try expectEqual(@as(u32, 1), b.admit(&id, &shard, matured, &admitted));
    _ = b.release(&.{index});
    _ = a.release(&.{index});
    try expectEqual(@as(u16, 3), target.reuses.load(.monotonic));
    const admitted_bits = (@as(u32, 0b11) << buffer_module.slot_flag_admitted_shift) |
        (@as(u32, 0b10) << buffer_module.slot_flag_matured_shift);
    try expectEqual(admitted_bits, target.flags.load(.monotonic));
    // Removed and loaded again: a new count, no admission bits.
    try expectEqual(@as(u64, 1), try a.remove(&id, null, false));
    a.get(&id, &shard, .{ .results = &result, .slots = &slot });
    try expectEqual(buffer_module.GetResult.owner, result[0]);
    try expectEqual(@as(u16, 0), base.slots[slot[0]].reuses.load(.monotonic));
    try expectEqual(@as(u32, 0), base.slots[slot[0]].flags.load(.monotonic) >> buffer_module.slot_flag_admitted_shift);
    _ = a.release(&.{slot[0]});
}
