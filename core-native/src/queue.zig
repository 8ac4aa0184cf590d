//! The native per-rank load queue (seed §1, §3.1, §3.4): tasks go in with one call, native
//! threads do the per-shard work, and the caller's thread (which holds the GIL in a real
//! engine) is never needed again until it asks whether the task is done.
//!
//! Threads (all pthreads, all signals blocked):
//! - a **load dispatcher** takes load tasks in order, walks each one in RearrangeIndex order
//!   (own stride first, then rotation; Scenario A) in steps of at most `step_keys` keys, one
//!   batched Get per step. Hits go to the copy threads at once; owned keys go to the caller's
//!   *loaders* (Python threads that read the tiers below) through the work ring; waiters sleep
//!   on the slot's futex, then go to the copy threads. A step ends when what it owns has been
//!   filled (or `wait_timeout_ns` passed), so a rank never claims more than it is loading. In
//!   the idle window after a task, it prewarms (block, index + 1) (Scenario E).
//! - a **prefetch dispatcher** walks prefetch tasks the same way, in a lane of their own: a
//!   prefetch's step waits for its fills from the tiers below, and a load queued behind a
//!   prefetch stalled on a slow tier would wait with it, even a load of blocks the buffer holds
//!   (a memcpy). Engines prefetch what they will wait on only later, or up to a deadline.
//! - a **dump dispatcher** does the buffer part of dump tasks: claim, copy in, commit Ready.
//! - `copy_threads` **copy threads** move bytes between slots and caller memory with the C
//!   library's memcpy, then release the slots and finish the entries.
//!
//! **Without a buffer** (a stack whose top tier is not the CacheBuffer) the queue runs on a
//! *null buffer*: there are no slots to claim, so every key of a load or prefetch step is
//! BYPASS work, loaded by a loader from the tiers below straight into its destination (a
//! prefetch into the top tier), and there are no dump tasks (the top tier takes dumps). The
//! queue is then the stack's only load engine all the same: RearrangeIndex order, steps,
//! `fill_parts` batches, queue depths, completion, counters.
//!
//! References: the CacheBuffer records one reference per *process* and slot (buffer.zig), so the
//! threads of this process share it through a local use count per slot (`uses`), changed under
//! `refs_mutex` together with the native Get/release that takes or drops the process's one
//! reference. `local_flags` remembers what this process knows of a slot it holds: owned here
//! (not committed yet) or Ready.
//!
//! Tasks live in a fixed pool of `queue_tasks_max` records, of which each lane holds at most
//! `queue_lane_depth_max` (queued or in flight); the caller's arrays (keys, caller
//! memory addresses, per-entry results) stay the caller's and must outlive the task. A task's
//! completion is one release store of its generation into the record's `completed` word and a
//! futex wake on it: `wait` blocks on that word, `done` reads it; nobody polls. After that store
//! no thread touches the caller's arrays again (the dispatcher holds one count of `remaining`
//! until it is finished with the task, prewarm included).
const std = @import("std");
const builtin = @import("builtin");
const linux = std.os.linux;
const constants = @import("constants.zig");
const buffer_module = @import("buffer.zig");
const futex = @import("futex.zig");
const populate = @import("populate.zig");
const seg_sys = @import("seg_sys.zig");

const assert = std.debug.assert;
const Atomic = std.atomic.Value;
const Buffer = buffer_module.Buffer;
const BlockId = buffer_module.BlockId;
const GetResult = buffer_module.GetResult;
const GetMode = buffer_module.GetMode;
const WaitResult = buffer_module.WaitResult;
const State = buffer_module.State;

extern "c" fn memcpy(noalias target: *anyopaque, noalias source: *const anyopaque, length_bytes: usize) *anyopaque;

/// Copies `length_bytes` from `source` to `target` (non-overlapping). On x86_64, ranges of at
/// least `queue_nontemporal_min_bytes` go through non-temporal stores (`movntdq`, SSE2, so any
/// x86_64): a load streams far more than the caches hold, and skipping the read-for-ownership
/// of every destination line measured 9.4 vs 6.8 GB/s on one thread here, 20-22 vs 13 GB/s on
/// four (memcpy's regular stores). The head up to a 64-byte boundary and the tail go through
/// memcpy. The caller fences (`store_fence`) before it publishes the bytes.
pub fn copy_bytes(target: usize, source: usize, length_bytes: usize) void {
    if (length_bytes == 0) return;
    assert(target != 0 and source != 0);
    if (builtin.cpu.arch != .x86_64 or length_bytes < constants.queue_nontemporal_min_bytes) {
        _ = memcpy(@ptrFromInt(target), @ptrFromInt(source), length_bytes);
        return;
    }
    const head = (constants.buffer_cache_line_bytes - target % constants.buffer_cache_line_bytes) % constants.buffer_cache_line_bytes;
    if (head > 0) _ = memcpy(@ptrFromInt(target), @ptrFromInt(source), head);
    const body = (length_bytes - head) & ~@as(usize, constants.buffer_cache_line_bytes - 1);
    assert((target + head) % constants.buffer_cache_line_bytes == 0);
    var offset: usize = head;
    while (offset < head + body) : (offset += constants.buffer_cache_line_bytes) {
        stream_line(target + offset, source + offset);
    }
    const tail = length_bytes - head - body;
    if (tail > 0) _ = memcpy(@ptrFromInt(target + head + body), @ptrFromInt(source + head + body), tail);
}

/// One 64-byte line: unaligned loads, aligned non-temporal stores.
inline fn stream_line(target: usize, source: usize) void {
    const to: [*]u8 = @ptrFromInt(target);
    const from: [*]const u8 = @ptrFromInt(source);
    asm volatile (
        \\ movdqu (%[s]), %%xmm0
        \\ movdqu 16(%[s]), %%xmm1
        \\ movdqu 32(%[s]), %%xmm2
        \\ movdqu 48(%[s]), %%xmm3
        \\ movntdq %%xmm0, (%[d])
        \\ movntdq %%xmm1, 16(%[d])
        \\ movntdq %%xmm2, 32(%[d])
        \\ movntdq %%xmm3, 48(%[d])
        :
        : [s] "r" (from),
          [d] "r" (to),
        : .{ .xmm0 = true, .xmm1 = true, .xmm2 = true, .xmm3 = true, .memory = true });
}

/// Orders the non-temporal stores before whatever publishes the bytes (a release store).
pub fn store_fence() void {
    if (builtin.cpu.arch == .x86_64) asm volatile ("sfence" ::: .{ .memory = true });
}

pub const TaskKind = enum(u8) { load = 0, prefetch = 1, dump = 2 };

/// Dump: commit the slots dirty (write-back debt, issue 11). Carried to the commit.
pub const task_flag_dirty: u32 = 1 << 0;
/// Load: nothing below the buffer; a key not Ready here is a miss, never handed to a loader.
/// Its keys are looked up, never claimed (`GetMode.lookup`): a key absent from the buffer
/// takes no slot, so a miss never evicts a Ready block.
/// A key another load is filling (this process's or another rank's) is waited for, as a
/// waiter's (up to `wait_timeout_ns`, longer while the filler is this process's), unless
/// `task_flag_no_wait` is set too.
pub const task_flag_no_fill: u32 = 1 << 1;
/// Load: nobody waits on it (an engine's asynchronous load): its copies yield the CPU after
/// each batch (see `copy_loop`). Dumps always do.
pub const task_flag_background: u32 = 1 << 2;
/// Load, with `task_flag_no_fill` only: a key not Ready when claimed is `missing` at once,
/// even one another load is filling: the task waits on no tier, not even through another
/// load's fill (an engine's synchronous load, which must cost a memcpy at most).
pub const task_flag_no_wait: u32 = 1 << 3;
pub const task_flags_valid: u32 = task_flag_dirty | task_flag_no_fill | task_flag_background | task_flag_no_wait;

/// Per entry (optional array): the caller copies this entry's bytes itself (a CUDA destination):
/// it gets a `copy_out` work item holding the Ready slot instead of a native copy.
pub const entry_flag_caller_copy: u8 = 1 << 0;

pub const settings_flag_prealloc: u32 = 1 << 0;
pub const settings_flag_rearrange: u32 = 1 << 1;

/// Final per-entry code, written into the caller's results array.
pub const EntryResult = enum(u8) {
    ok = 0,
    /// A loader reported a failure; the caller recorded why.
    caller_failed = 1,
    /// Another rank's owner committed Failed.
    owner_failed = 2,
    /// Another rank's owner found the key in no tier.
    owner_missing = 3,
    /// Dump: every slot is in use.
    no_slot = 4,
    /// A bucket lock stayed held by a live process past the lock timeout.
    lock_timeout = 5,
    /// Shared memory ran out while faulting the slot in.
    no_memory = 6,
    /// `task_flag_no_fill`: not Ready in the buffer (`task_flag_no_wait`: when claimed).
    missing = 7,
    /// A loader could not hand a caller copy on: the work ring stayed full (its consumers are
    /// the loaders themselves, so a loader never waits on it for long).
    backlog = 8,
    /// Transient: a loader's report of the entry is being applied.
    reported = 254,
    pending = 255,
};

pub const WorkKind = enum(u8) {
    /// Fill the slot (owned here) from the tiers below; report ready/failed/missing.
    fill = 0,
    /// Load the entry from the tiers below straight into its destination (no slot held).
    bypass = 1,
    /// Copy the Ready slot into the entry's destination (caller copy), then report.
    copy_out = 2,
};

/// What a loader reports per work item (`fill` uses ready, failed and missing; `copy_out`
/// ready or failed; `bypass` ready or failed, or `hit` on a null buffer).
pub const WorkState = enum(u8) {
    ready = 1,
    failed = 2,
    missing = 3,
    /// Null buffer only: loaded, and served by the top tier (the stack's cache), so the load
    /// counts a hit; `ready` there means served from further below (a miss).
    hit = 4,
};

pub const Status = enum(i32) {
    ok = 0,
    invalid_argument = -1,
    /// The task pool or the lane stayed full for the whole timeout.
    full = -2,
    /// The queue is closing or stopped.
    closed = -3,
    /// Called from another process than the one that created the queue (after fork()).
    wrong_process = -4,
    out_of_memory = -5,
};

pub const Settings = extern struct {
    shard_size_bytes: u64,
    wait_timeout_ns: u64,
    device_id: u32,
    local_rank_size: u32,
    shards_per_block: u32,
    tensor_count: u32,
    step_keys: u32,
    copy_threads: u32,
    /// Work batches a step's owned keys are cut into (the concurrent loads of the tiers below).
    fill_parts: u32,
    load_queue_depth: u32,
    dump_queue_depth: u32,
    flags: u32,
};

comptime {
    assert(@sizeOf(Settings) == 2 * 8 + 10 * 4);
}

pub const counter_names = [_][]const u8{
    "hits",              "misses",      "loaded_shards", "dumped_shards", "failed_shards",
    "prefetched_shards", "owned",       "waited",        "bypassed",      "takeovers",
    "prewarmed",         "get_ns",      "get_keys",      "copy_bytes",    "copy_ns",
    "load_tasks",        "dump_tasks",  "work_items",    "no_memory",     "release_failures",
    "wait_timeouts",     "wait_ns_max", "dump_refills",
};
pub const Counter = enum(u32) {
    hits,
    misses,
    loaded_shards,
    dumped_shards,
    failed_shards,
    prefetched_shards,
    owned,
    waited,
    bypassed,
    takeovers,
    prewarmed,
    get_ns,
    get_keys,
    copy_bytes,
    copy_ns,
    load_tasks,
    dump_tasks,
    work_items,
    no_memory,
    release_failures,
    /// Waits that ran out behind a live owner (the key was then loaded from below).
    wait_timeouts,
    /// The longest single wait on a slot another rank (or thread) was filling.
    wait_ns_max,
    /// Dump keys whose slot another load was filling when that fill ended Failed or Missing:
    /// the dump claimed the key again and wrote its own bytes (or, past the last round,
    /// reported NO_SLOT so that the store writes them straight down).
    dump_refills,
};
pub const counter_count = counter_names.len;

comptime {
    assert(@typeInfo(Counter).@"enum".fields.len == counter_count);
}

const local_flag_owned: u8 = 1 << 0;
const local_flag_ready: u8 = 1 << 1;

const task_none: u32 = std.math.maxInt(u32);

const Task = struct {
    kind: TaskKind = .load,
    flags: u32 = 0,
    entry_count: u32 = 0,
    tag: u64 = 0,
    ids: [*]const BlockId = undefined,
    shards: [*]const u32 = undefined,
    /// `entry_count * tensor_count` caller addresses (destinations or sources), or null.
    addresses: ?[*]const u64 = null,
    entry_flags: ?[*]const u8 = null,
    results: [*]u8 = undefined,
    /// Entries not finished yet, plus one held by the dispatcher until it is done with the task.
    remaining: Atomic(u32) = Atomic(u32).init(0),
    generation: u32 = 0,
    /// Futex word: the generation of the last completed use of this record.
    completed: Atomic(u32) = Atomic(u32).init(0),
    next_free: u32 = task_none,
    live: bool = false,
};

pub const WorkItem = struct {
    task: u32,
    /// The task record's generation when the item was made (its token's high half).
    generation: u32 = 0,
    entry: u32,
    slot: u32,
    step: u32,
    kind: WorkKind,
    /// The last item of a batch a loader takes at once.
    batch_end: bool,
};

const CopyItem = struct {
    task: u32,
    generation: u32 = 0,
    entry: u32,
    slot: u32,
};

/// A bounded FIFO of items shared by producers and consumers under one mutex. Producers block
/// while it is full (backpressure); consumers block while it is empty, until it is stopped.
fn Ring(comptime Item: type) type {
    return struct {
        const Self = @This();
        items: []Item,
        head: usize = 0,
        count: usize = 0,
        stopped: bool = false,
        mutex: std.Thread.Mutex = .{},
        not_empty: std.Thread.Condition = .{},
        not_full: std.Thread.Condition = .{},

        /// Appends an item, waiting while the ring is full: consumers always make progress
        /// (copies finish; loaders come back after each batch). A stopped ring drops it (the
        /// queue is being torn down; its tasks never complete).
        fn push(ring: *Self, item: Item) void {
            const pushed = ring.try_push(item, std.math.maxInt(u64));
            assert(pushed); // no deadline: only a stopped ring ends the wait, and it drops
        }

        /// Appends an item, waiting at most `timeout_ns` for room (the ring's own consumers, a
        /// loader handing on work, must not wait long: every consumer may be waiting here at
        /// once). False when the ring stayed full; a stopped ring drops the item (true).
        fn try_push(ring: *Self, item: Item, timeout_ns: u64) bool {
            ring.mutex.lock();
            defer ring.mutex.unlock();
            const deadline_ns = futex.monotonic_ns() +| timeout_ns;
            var rounds: u64 = 0;
            while (ring.count == ring.items.len) : (rounds += 1) {
                assert(rounds < std.math.maxInt(u64));
                if (ring.stopped) return true;
                const now_ns = futex.monotonic_ns();
                if (now_ns >= deadline_ns) return false;
                const slice_ns = @min(deadline_ns - now_ns, constants.queue_ring_wait_slice_ns);
                ring.not_full.timedWait(&ring.mutex, slice_ns) catch {};
            }
            if (ring.stopped) return true;
            ring.items[(ring.head + ring.count) % ring.items.len] = item;
            ring.count += 1;
            ring.not_empty.signal();
            return true;
        }

        fn stop(ring: *Self) void {
            ring.mutex.lock();
            defer ring.mutex.unlock();
            ring.stopped = true;
            ring.not_empty.broadcast();
            ring.not_full.broadcast();
        }

        /// Waits up to `timeout_ns` for an item. False when none came or the ring is stopped
        /// and empty. Returns with the mutex held when true.
        fn wait_item_locked(ring: *Self, timeout_ns: u64) bool {
            const deadline_ns = futex.monotonic_ns() +| timeout_ns;
            var rounds: u64 = 0;
            while (ring.count == 0) : (rounds += 1) {
                assert(rounds < std.math.maxInt(u32));
                if (ring.stopped) return false;
                const now_ns = futex.monotonic_ns();
                if (now_ns >= deadline_ns) return false;
                const slice_ns = @min(deadline_ns - now_ns, constants.queue_ring_wait_slice_ns);
                ring.not_empty.timedWait(&ring.mutex, slice_ns) catch {};
            }
            return true;
        }

        fn pop_locked(ring: *Self) Item {
            assert(ring.count > 0);
            const item = ring.items[ring.head];
            ring.head = (ring.head + 1) % ring.items.len;
            ring.count -= 1;
            ring.not_full.signal();
            return item;
        }
    };
}

const Lane = struct {
    /// Task indexes waiting for this lane's dispatcher, in submit order.
    pending: [constants.queue_tasks_max]u32 = undefined,
    head: u32 = 0,
    count: u32 = 0,
    depth: u32 = 0,
    /// This lane's tasks submitted and not completed (queued or walked): at most
    /// `queue_lane_depth_max`, so that the three lanes together never need more than the
    /// pool's `queue_tasks_max` records. A task walked past its step's `wait_timeout` stays in
    /// flight while its fills do (a stalled tier's): without this bound one lane's such tasks
    /// would take every record, and a load of buffer hits would find none.
    live: u32 = 0,
    not_empty: std.Thread.Condition = .{},
    thread: ?std.Thread = null,
    // Step scratch (dispatcher-local): `step_keys` entries each.
    ids: []BlockId = &.{},
    shards: []u32 = &.{},
    results: []GetResult = &.{},
    slots: []u32 = &.{},
    entries: []u32 = &.{},
    /// Dump lane: keys already Ready, replaced after the step (remove, then claim again).
    again: []u32 = &.{},
    /// Load and prefetch lanes: the current step (high 32 bits) and its owned keys not filled
    /// yet (low 32). A fill reports to its task's lane (`lane_of`).
    step_word: Atomic(u64) = Atomic(u64).init(0),
    /// Futex word bumped when the current step's last owned key is filled.
    step_wake: Atomic(u32) = Atomic(u32).init(0),
};

/// The walk order of a task as at most `local_rank_size` pieces, each `start, start +
/// stride, ... < end`. RearrangeIndex (seed 3.1): this rank's stride (start `device_id % L`,
/// stride L) first, then the others in rotation (Scenario A). Natural order (kept to measure
/// what the rotation buys): L contiguous pieces, so every rank claims the same piece at once.
/// The one implementation of RearrangeIndex: the dispatcher walks tasks in it, and
/// `ucm_queue_walk_order` hands it to tests and benchmarks.
pub const Piece = struct { start: u32, stride: u32, end: u32 };
pub const Walk = struct {
    pieces: [constants.queue_local_rank_size_max]Piece,
    piece_count: u32,
};

pub fn walk_order(n: u32, device_id: u32, ranks: u32, rearrange: bool) Walk {
    var walk = Walk{ .pieces = undefined, .piece_count = 0 };
    assert(ranks >= 1 and ranks <= constants.queue_local_rank_size_max);
    if (n == 0) return walk;
    if (rearrange) {
        const first = device_id % ranks;
        for (0..ranks) |k| {
            const start: u32 = @intCast((first + k) % ranks);
            if (start >= n) continue;
            walk.pieces[walk.piece_count] = .{ .start = start, .stride = ranks, .end = n };
            walk.piece_count += 1;
        }
    } else {
        const width = std.math.divCeil(u32, n, ranks) catch unreachable;
        var start: u32 = 0;
        while (start < n) : (start += width) {
            assert(walk.piece_count < ranks);
            walk.pieces[walk.piece_count] = .{ .start = start, .stride = 1, .end = @min(n, start + width) };
            walk.piece_count += 1;
        }
    }
    assert(walk.piece_count >= 1);
    return walk;
}

/// Writes the walk of `n` entries into `out` (a permutation of 0..n): the dispatcher's order.
pub fn walk_positions(walk: Walk, out: []u32) usize {
    var written: usize = 0;
    for (walk.pieces[0..walk.piece_count]) |piece| {
        var position = piece.start;
        while (position < piece.end) : (position += piece.stride) {
            assert(written < out.len);
            out[written] = position;
            written += 1;
        }
    }
    return written;
}

test "walk_order: Scenario A (4 ranks, 12 shards) and natural order" {
    var out: [12]u32 = undefined;
    const expected = [4][12]u32{
        .{ 0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11 },
        .{ 1, 5, 9, 2, 6, 10, 3, 7, 11, 0, 4, 8 },
        .{ 2, 6, 10, 3, 7, 11, 0, 4, 8, 1, 5, 9 },
        .{ 3, 7, 11, 0, 4, 8, 1, 5, 9, 2, 6, 10 },
    };
    for (expected, 0..) |order, rank| {
        try std.testing.expectEqual(@as(usize, 12), walk_positions(walk_order(12, @intCast(rank), 4, true), &out));
        try std.testing.expectEqualSlices(u32, &order, &out);
    }
    try std.testing.expectEqual(@as(usize, 12), walk_positions(walk_order(12, 2, 4, false), &out));
    for (out, 0..) |position, i| try std.testing.expectEqual(@as(u32, @intCast(i)), position);
}

pub const Queue = struct {
    allocator: std.mem.Allocator,
    /// The CacheBuffer, or null: no slots, every key is BYPASS (see the file's doc).
    buffer: ?Buffer,
    pid: u32,
    settings: Settings,
    tensor_sizes: []u64,
    segment_bases: []usize,
    /// The data mapping's populater (slot pages are faulted in before they are written), or
    /// null when the caller's memory is not a populated region (tests).
    populater: ?*const populate.Populater,

    refs_mutex: std.Thread.Mutex = .{},
    uses: []u32,
    local_flags: []u8,
    /// Slots this process holds through the queue (uses > 0), under `refs_mutex`.
    claimed: u32 = 0,
    /// Uses held by pins (`pin` .. `unpin`), under `refs_mutex`: not counted against the
    /// claim budget, since they are held for as long as the caller wants.
    pinned: u32 = 0,
    /// Futex word bumped when slots are released while a dispatcher waits for room.
    released_word: Atomic(u32) = Atomic(u32).init(0),
    room_waiters: Atomic(u32) = Atomic(u32).init(0),

    /// Guards the task pool, the lanes and `closing`.
    mutex: std.Thread.Mutex = .{},
    space: std.Thread.Condition = .{},
    drained: std.Thread.Condition = .{},
    tasks: [constants.queue_tasks_max]Task = @splat(.{}),
    free_head: u32 = task_none,
    tasks_live: u32 = 0,
    closing: bool = false,
    stopping: bool = false,
    /// `stopping` for threads outside the mutex.
    stop_flag: Atomic(bool) = Atomic(bool).init(false),
    lanes: [3]Lane = .{ .{}, .{}, .{} },

    work: Ring(WorkItem),
    copies: Ring(CopyItem),
    copy_threads: [constants.queue_copy_threads_max]std.Thread = undefined,
    copy_thread_count: u32 = 0,

    counters: [counter_count]Atomic(u64) = @splat(Atomic(u64).init(0)),

    const load_lane = 0;
    const dump_lane = 1;
    const prefetch_lane = 2;

    fn lane_of(kind: TaskKind) u32 {
        return switch (kind) {
            .load => load_lane,
            .prefetch => prefetch_lane,
            .dump => dump_lane,
        };
    }

    pub fn validate_settings(settings: Settings, buffer: ?Buffer) bool {
        if (settings.shard_size_bytes == 0) return false;
        if (buffer) |view| {
            if (settings.shard_size_bytes != view.geometry.shard_size_bytes) return false;
        }
        if (settings.local_rank_size == 0 or settings.local_rank_size > constants.queue_local_rank_size_max) return false;
        if (settings.shards_per_block == 0) return false;
        if (settings.tensor_count == 0 or settings.tensor_count > constants.queue_tensors_max) return false;
        if (settings.step_keys == 0 or settings.step_keys > constants.queue_step_keys_max) return false;
        if (settings.copy_threads == 0 or settings.copy_threads > constants.queue_copy_threads_max) return false;
        if (settings.fill_parts == 0 or settings.fill_parts > constants.queue_fill_parts_max) return false;
        if (settings.load_queue_depth == 0 or settings.dump_queue_depth == 0) return false;
        if (settings.load_queue_depth > constants.queue_lane_depth_max) return false;
        if (settings.dump_queue_depth > constants.queue_lane_depth_max) return false;
        if (settings.flags & ~(settings_flag_prealloc | settings_flag_rearrange) != 0) return false;
        return true;
    }

    /// Creates the queue and starts its threads. `buffer` acts as this process's holder; null
    /// for a stack without a buffer (no segments, no populater).
    pub fn create(
        allocator: std.mem.Allocator,
        buffer: ?Buffer,
        settings: Settings,
        tensor_sizes: []const u64,
        segment_bases: []const usize,
        populater: ?*const populate.Populater,
    ) error{ OutOfMemory, SystemResources }!*Queue {
        assert(validate_settings(settings, buffer));
        assert(tensor_sizes.len == settings.tensor_count);
        var slot_count: usize = 0;
        if (buffer) |view| {
            assert(view.holder < constants.buffer_holders_max);
            assert(segment_bases.len == view.header.segment_count);
            slot_count = view.slots.len;
        } else {
            assert(segment_bases.len == 0);
            assert(populater == null);
        }
        const queue = try allocator.create(Queue);
        errdefer allocator.destroy(queue);
        queue.* = .{
            .allocator = allocator,
            .buffer = buffer,
            .pid = buffer_module.current_pid(),
            .settings = settings,
            .tensor_sizes = try allocator.dupe(u64, tensor_sizes),
            .segment_bases = undefined,
            .populater = populater,
            .uses = undefined,
            .local_flags = undefined,
            .work = .{ .items = undefined },
            .copies = .{ .items = undefined },
        };
        errdefer allocator.free(queue.tensor_sizes);
        queue.segment_bases = try allocator.dupe(usize, segment_bases);
        errdefer allocator.free(queue.segment_bases);
        queue.uses = try allocator.alloc(u32, slot_count);
        errdefer allocator.free(queue.uses);
        @memset(queue.uses, 0);
        queue.local_flags = try allocator.alloc(u8, slot_count);
        errdefer allocator.free(queue.local_flags);
        @memset(queue.local_flags, 0);
        queue.work.items = try allocator.alloc(WorkItem, constants.queue_ring_items);
        errdefer allocator.free(queue.work.items);
        queue.copies.items = try allocator.alloc(CopyItem, constants.queue_ring_items);
        errdefer allocator.free(queue.copies.items);
        var sum: u64 = 0;
        for (tensor_sizes) |size| sum += size;
        assert(sum == settings.shard_size_bytes);
        for (&queue.tasks, 0..) |*task, index| {
            task.next_free = if (index + 1 < queue.tasks.len) @intCast(index + 1) else task_none;
        }
        queue.free_head = 0;
        queue.lanes[load_lane].depth = settings.load_queue_depth;
        queue.lanes[prefetch_lane].depth = settings.load_queue_depth;
        queue.lanes[dump_lane].depth = settings.dump_queue_depth;
        errdefer queue.free_scratch();
        for (&queue.lanes) |*lane| {
            const keys = settings.step_keys;
            lane.ids = try allocator.alloc(BlockId, keys);
            lane.shards = try allocator.alloc(u32, keys);
            lane.results = try allocator.alloc(GetResult, keys);
            lane.slots = try allocator.alloc(u32, keys);
            lane.entries = try allocator.alloc(u32, keys);
            lane.again = try allocator.alloc(u32, keys);
        }
        errdefer queue.stop_and_join();
        queue.lanes[load_lane].thread = std.Thread.spawn(.{}, dispatch_loop, .{ queue, @as(u32, load_lane) }) catch
            return error.SystemResources;
        // Named for `top -H` and per-thread profiles; a refused name changes nothing else.
        queue.lanes[load_lane].thread.?.setName("ucm-load-lane") catch {};
        queue.lanes[dump_lane].thread = std.Thread.spawn(.{}, dispatch_loop, .{ queue, @as(u32, dump_lane) }) catch
            return error.SystemResources;
        queue.lanes[dump_lane].thread.?.setName("ucm-dump-lane") catch {};
        queue.lanes[prefetch_lane].thread = std.Thread.spawn(.{}, dispatch_loop, .{ queue, @as(u32, prefetch_lane) }) catch
            return error.SystemResources;
        queue.lanes[prefetch_lane].thread.?.setName("ucm-prefetch") catch {};
        var index: u32 = 0;
        while (index < settings.copy_threads) : (index += 1) {
            queue.copy_threads[index] = std.Thread.spawn(.{}, copy_loop, .{queue}) catch
                return error.SystemResources;
            queue.copy_threads[index].setName("ucm-copy") catch {};
            queue.copy_thread_count = index + 1;
        }
        return queue;
    }

    fn free_scratch(queue: *Queue) void {
        const allocator = queue.allocator;
        for (&queue.lanes) |*lane| {
            if (lane.ids.len > 0) allocator.free(lane.ids);
            if (lane.shards.len > 0) allocator.free(lane.shards);
            if (lane.results.len > 0) allocator.free(lane.results);
            if (lane.slots.len > 0) allocator.free(lane.slots);
            if (lane.entries.len > 0) allocator.free(lane.entries);
            if (lane.again.len > 0) allocator.free(lane.again);
            lane.ids = &.{};
            lane.shards = &.{};
            lane.results = &.{};
            lane.slots = &.{};
            lane.entries = &.{};
            lane.again = &.{};
        }
    }

    /// Stops every thread (after `drain`, or with tasks left: they never complete) and frees
    /// the queue. The caller's loaders must have left `next_work` (it returns `closed`).
    pub fn destroy(queue: *Queue) void {
        queue.stop_and_join();
        const allocator = queue.allocator;
        queue.free_scratch();
        allocator.free(queue.copies.items);
        allocator.free(queue.work.items);
        allocator.free(queue.local_flags);
        allocator.free(queue.uses);
        allocator.free(queue.segment_bases);
        allocator.free(queue.tensor_sizes);
        allocator.destroy(queue);
    }

    /// Stops the threads; idempotent. Work and copy rings stop, so loaders get `closed`.
    pub fn stop_and_join(queue: *Queue) void {
        queue.mutex.lock();
        queue.closing = true;
        queue.stopping = true;
        queue.stop_flag.store(true, .monotonic);
        for (&queue.lanes) |*lane| lane.not_empty.broadcast();
        queue.space.broadcast();
        queue.mutex.unlock();
        queue.work.stop();
        queue.copies.stop();
        for (&queue.lanes) |*lane| {
            if (lane.thread) |thread| thread.join();
            lane.thread = null;
        }
        for (queue.copy_threads[0..queue.copy_thread_count]) |thread| thread.join();
        queue.copy_thread_count = 0;
    }

    pub fn count(queue: *Queue, counter: Counter, amount: u64) void {
        if (amount == 0) return;
        // Monotonic: statistics order nothing else.
        _ = queue.counters[@intFromEnum(counter)].fetchAdd(amount, .monotonic);
    }

    fn count_max(queue: *Queue, counter: Counter, value: u64) void {
        // Monotonic: statistics order nothing else.
        _ = queue.counters[@intFromEnum(counter)].fetchMax(value, .monotonic);
    }

    pub fn counter_value(queue: *const Queue, counter: Counter) u64 {
        return queue.counters[@intFromEnum(counter)].load(.monotonic);
    }

    // ---------------------------------------------------------------------------------------
    // Submission and completion.

    pub const Submission = struct {
        kind: TaskKind,
        flags: u32,
        ids: []const BlockId,
        shards: []const u32,
        addresses: ?[]const u64,
        entry_flags: ?[]const u8,
        results: []u8,
        tag: u64,
    };

    /// Checks a submission against the settings; never trusts the caller.
    pub fn validate(queue: *const Queue, submission: Submission) bool {
        const n = submission.ids.len;
        if (submission.shards.len != n or submission.results.len != n) return false;
        if (n > constants.queue_task_keys_max) return false;
        if (submission.flags & ~task_flags_valid != 0) return false;
        if (submission.kind != .dump and submission.flags & task_flag_dirty != 0) return false;
        if (submission.kind != .load and submission.flags & task_flag_background != 0) return false;
        if (submission.kind == .dump and submission.flags & task_flag_no_fill != 0) return false;
        // A null buffer has no slots to dump into (the top tier takes dumps).
        if (submission.kind == .dump and queue.buffer == null) return false;
        if (submission.flags & task_flag_no_fill != 0 and queue.buffer == null) return false;
        if (submission.flags & task_flag_no_wait != 0) {
            if (submission.kind != .load or submission.flags & task_flag_no_fill == 0) return false;
        }
        for (submission.shards) |shard| {
            if (shard >= queue.settings.shards_per_block) return false;
        }
        if (submission.kind == .prefetch) {
            if (submission.addresses != null or submission.entry_flags != null) return false;
            return true;
        }
        const addresses = submission.addresses orelse return false;
        if (addresses.len != n * queue.settings.tensor_count) return false;
        for (addresses) |address| {
            if (address == 0) return false;
        }
        if (submission.entry_flags) |entry_flags| {
            if (submission.kind != .load or entry_flags.len != n) return false;
            for (entry_flags) |flags| {
                if (flags & ~entry_flag_caller_copy != 0) return false;
            }
        }
        return true;
    }

    /// Hands a task over. Blocks up to `timeout_ns` while the lane is at its depth or holds
    /// `queue_lane_depth_max` tasks in flight (a record is then always free: the other lanes
    /// hold at most as many each). Returns the token (generation << 32 | record index).
    pub fn submit(queue: *Queue, submission: Submission, timeout_ns: u64) error{ Full, Closed }!u64 {
        assert(queue.validate(submission));
        const lane = &queue.lanes[lane_of(submission.kind)];
        @memset(submission.results, @intFromEnum(EntryResult.pending));
        queue.mutex.lock();
        defer queue.mutex.unlock();
        const deadline_ns = futex.monotonic_ns() +| timeout_ns;
        var rounds: u64 = 0;
        while (lane.count >= lane.depth or lane.live >= constants.queue_lane_depth_max) : (rounds += 1) {
            assert(rounds < std.math.maxInt(u32));
            if (queue.closing) return error.Closed;
            const now_ns = futex.monotonic_ns();
            if (now_ns >= deadline_ns) return error.Full;
            queue.space.timedWait(&queue.mutex, @min(deadline_ns - now_ns, constants.queue_ring_wait_slice_ns)) catch {};
        }
        if (queue.closing) return error.Closed;
        comptime assert(constants.queue_tasks_max >= 3 * constants.queue_lane_depth_max);
        assert(queue.tasks_live == queue.lanes[0].live + queue.lanes[1].live + queue.lanes[2].live);
        assert(queue.free_head != task_none); // every lane holds at most its share of records
        const index = queue.free_head;
        const task = &queue.tasks[index];
        assert(!task.live);
        queue.free_head = task.next_free;
        task.kind = submission.kind;
        task.flags = submission.flags;
        task.entry_count = @intCast(submission.ids.len);
        task.tag = submission.tag;
        task.ids = submission.ids.ptr;
        task.shards = submission.shards.ptr;
        task.addresses = if (submission.addresses) |a| a.ptr else null;
        task.entry_flags = if (submission.entry_flags) |f| f.ptr else null;
        task.results = submission.results.ptr;
        task.generation +%= 1;
        if (task.generation == 0) task.generation = 1;
        // Monotonic: published to the dispatcher by the mutex.
        task.remaining.store(task.entry_count + 1, .monotonic);
        task.next_free = task_none;
        task.live = true;
        queue.tasks_live += 1;
        lane.live += 1;
        lane.pending[(lane.head + lane.count) % lane.pending.len] = index;
        lane.count += 1;
        lane.not_empty.signal();
        switch (submission.kind) {
            .load => queue.count(.load_tasks, 1),
            .dump => queue.count(.dump_tasks, 1),
            .prefetch => {},
        }
        return (@as(u64, task.generation) << 32) | index;
    }

    fn token_parts(token: u64) struct { index: u32, generation: u32 } {
        return .{ .index = @truncate(token), .generation = @intCast(token >> 32) };
    }

    /// Whether the task of `token` completed (null: not a token this queue handed out).
    pub fn done(queue: *Queue, token: u64) ?bool {
        const parts = token_parts(token);
        if (parts.index >= queue.tasks.len or parts.generation == 0) return null;
        const task = &queue.tasks[parts.index];
        // Acquire: pairs with the release store in `complete`; the results are then visible.
        const completed = task.completed.load(.acquire);
        return @as(i32, @bitCast(completed -% parts.generation)) >= 0;
    }

    /// Blocks (futex, no polling) until the task completes or `timeout_ns` passes.
    pub fn wait(queue: *Queue, token: u64, timeout_ns: u64) ?bool {
        const parts = token_parts(token);
        if (parts.index >= queue.tasks.len or parts.generation == 0) return null;
        const task = &queue.tasks[parts.index];
        const deadline_ns = futex.monotonic_ns() +| timeout_ns;
        var rounds: u64 = 0;
        while (rounds < std.math.maxInt(u32)) : (rounds += 1) {
            const completed = task.completed.load(.acquire);
            if (@as(i32, @bitCast(completed -% parts.generation)) >= 0) return true;
            const now_ns = futex.monotonic_ns();
            if (now_ns >= deadline_ns) return false;
            _ = futex.wait(&task.completed, completed, deadline_ns - now_ns);
        }
        return false;
    }

    /// Blocks until no task is live (every submitted task completed) or `timeout_ns` passes;
    /// refuses new submissions from now on.
    pub fn drain(queue: *Queue, timeout_ns: u64) bool {
        queue.mutex.lock();
        defer queue.mutex.unlock();
        queue.closing = true;
        queue.space.broadcast();
        const deadline_ns = futex.monotonic_ns() +| timeout_ns;
        var rounds: u64 = 0;
        while (queue.tasks_live > 0) : (rounds += 1) {
            assert(rounds < std.math.maxInt(u32));
            const now_ns = futex.monotonic_ns();
            if (now_ns >= deadline_ns) return false;
            queue.drained.timedWait(&queue.mutex, @min(deadline_ns - now_ns, constants.queue_ring_wait_slice_ns)) catch {};
        }
        return true;
    }

    fn finish_entry(queue: *Queue, task_index: u32, entry: u32, result: EntryResult) void {
        const task = &queue.tasks[task_index];
        assert(task.live);
        assert(entry < task.entry_count);
        assert(result != .pending);
        // Each entry is finished exactly once; a loader's report claimed it first (`reported`).
        const current = @atomicLoad(u8, &task.results[entry], .monotonic);
        assert(current == @intFromEnum(EntryResult.pending) or current == @intFromEnum(EntryResult.reported));
        // Monotonic: published by the release store that completes the task.
        @atomicStore(u8, &task.results[entry], @intFromEnum(result), .monotonic);
        if (result != .ok) queue.count(.failed_shards, 1);
        queue.release_task(task_index);
    }

    /// Drops one count of `remaining`; the last completes the task.
    fn release_task(queue: *Queue, task_index: u32) void {
        const task = &queue.tasks[task_index];
        // AcqRel: the last decrement sees every result written by the other threads.
        const previous = task.remaining.fetchSub(1, .acq_rel);
        assert(previous > 0);
        if (previous == 1) queue.complete(task_index);
    }

    fn complete(queue: *Queue, task_index: u32) void {
        const task = &queue.tasks[task_index];
        const generation = task.generation;
        queue.mutex.lock();
        defer queue.mutex.unlock();
        assert(task.live);
        task.live = false;
        task.next_free = queue.free_head;
        queue.free_head = task_index;
        assert(queue.tasks_live > 0);
        queue.tasks_live -= 1;
        const lane = &queue.lanes[lane_of(task.kind)];
        assert(lane.live > 0);
        lane.live -= 1;
        // Release: every result byte and copied destination byte is visible to whoever
        // acquires the generation. The caller's arrays are not touched after this store.
        task.completed.store(generation, .release);
        _ = futex.wake_all(&task.completed);
        queue.space.broadcast(); // submitters of every lane wait on this one condition
        if (queue.tasks_live == 0) queue.drained.broadcast();
    }

    // ---------------------------------------------------------------------------------------
    // Local references.

    /// Batched Get plus the local use counts: HELD (this process holds the slot already) is
    /// resolved here into HIT (known Ready) or WAITER (being filled, here or elsewhere).
    /// `mode` `.lookup` (no-fill loads): a key not Ready that nobody fills is `absent`, with
    /// no slot allocated for it (so no Ready block evicted for a key that will not be filled).
    fn claim(queue: *Queue, mode: GetMode, ids: []const BlockId, shards: []const u32, results: []GetResult, slots: []u32) void {
        assert(ids.len == shards.len and results.len == ids.len and slots.len == ids.len);
        const started_ns = futex.monotonic_ns();
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        queue.buffer.?.get_as(mode, ids, shards, .{ .results = results, .slots = slots });
        for (results, slots) |*result, slot| {
            switch (result.*) {
                .hit, .owner, .waiter => {
                    assert(queue.uses[slot] == 0);
                    queue.uses[slot] = 1;
                    queue.claimed += 1;
                    queue.local_flags[slot] = switch (result.*) {
                        .hit => local_flag_ready,
                        .owner => local_flag_owned,
                        else => 0,
                    };
                },
                .held => {
                    assert(queue.uses[slot] > 0);
                    queue.uses[slot] += 1;
                    const flags = queue.local_flags[slot];
                    if (flags & local_flag_ready != 0) {
                        result.* = .hit;
                    } else if (flags & local_flag_owned != 0) {
                        result.* = .waiter;
                    } else if (queue.buffer.?.slots[slot].state.load(.acquire) == @intFromEnum(State.ready)) {
                        queue.local_flags[slot] = local_flag_ready;
                        result.* = .hit;
                    } else {
                        result.* = .waiter;
                    }
                },
                .no_slot, .lock_timeout => {},
                .absent => assert(mode == .lookup),
            }
        }
        queue.count(.get_ns, futex.monotonic_ns() - started_ns);
        queue.count(.get_keys, ids.len);
    }

    /// Drops one local use per slot; the process's native reference goes with the last use.
    fn release_slots(queue: *Queue, slots: []u32) void {
        if (slots.len == 0) return;
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        var last: usize = 0;
        for (slots) |slot| {
            assert(queue.uses[slot] > 0);
            queue.uses[slot] -= 1;
            if (queue.uses[slot] == 0) {
                queue.local_flags[slot] = 0;
                // In place: `last` never passes the read position.
                slots[last] = slot;
                last += 1;
            }
        }
        const released = queue.buffer.?.release(slots[0..last]);
        queue.count(.release_failures, last - released);
        assert(queue.claimed >= last);
        queue.claimed -= @intCast(last);
        // Acquire: a dispatcher that announced itself before our decrement is woken.
        if (last > 0 and queue.room_waiters.load(.acquire) > 0) {
            _ = queue.released_word.fetchAdd(1, .release);
            _ = futex.wake_all(&queue.released_word);
        }
    }

    /// Most slots the queue holds at once: half the regular pool, so that the copies of one
    /// step can still run while the next claims, and a task larger than the buffer (or the
    /// lanes together) never claims every slot and starves itself into NO_SLOT.
    fn claim_budget(queue: *const Queue) u32 {
        return @max(1, queue.buffer.?.geometry.slot_count_regular / 2);
    }

    /// Waits until `keys` more slots fit the budget (the copies of earlier steps release
    /// theirs), up to `wait_timeout_ns`; a step that still does not fit claims anyway.
    fn wait_room(queue: *Queue, keys: usize) void {
        const budget = queue.claim_budget();
        const deadline_ns = futex.monotonic_ns() +| queue.settings.wait_timeout_ns;
        _ = queue.room_waiters.fetchAdd(1, .acq_rel);
        defer _ = queue.room_waiters.fetchSub(1, .acq_rel);
        var rounds: u64 = 0;
        while (rounds < std.math.maxInt(u32)) : (rounds += 1) {
            // Read the word before the count: a release in between changes the word.
            const word = queue.released_word.load(.acquire);
            queue.refs_mutex.lock();
            const active = queue.claimed -| queue.pinned;
            const fits = active == 0 or active + keys <= budget;
            queue.refs_mutex.unlock();
            if (fits) return;
            const now_ns = futex.monotonic_ns();
            if (now_ns >= deadline_ns or queue.stop_requested()) return;
            _ = futex.wait(&queue.released_word, word, @min(deadline_ns - now_ns, constants.queue_ring_wait_slice_ns));
        }
    }

    fn release_one(queue: *Queue, slot: u32) void {
        var one = [1]u32{slot};
        queue.release_slots(&one);
    }

    /// Publishes a slot owned here: the native commit (wakes other ranks), then the local flags.
    fn commit(queue: *Queue, slot: u32, state: State, dirty: bool) bool {
        assert(state != .idle);
        // A dump into a buffer with `write: back` tiers below commits Ready *and* dirty: the
        // slot is then never an eviction victim until a flusher wrote it down.
        var out = [1]buffer_module.CommitResult{.ok};
        var code: u8 = @intCast(@intFromEnum(state));
        if (dirty and state == .ready) code |= buffer_module.commit_dirty_bit;
        queue.buffer.?.commit(&.{slot}, &.{code}, &out);
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        assert(queue.uses[slot] > 0);
        queue.local_flags[slot] = if (out[0] == .ok and state == .ready) local_flag_ready else 0;
        return out[0] == .ok;
    }

    fn locally_owned(queue: *Queue, slot: u32) bool {
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        return queue.local_flags[slot] & local_flag_owned != 0;
    }

    fn mark_owned(queue: *Queue, slot: u32) void {
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        assert(queue.uses[slot] > 0);
        queue.local_flags[slot] = local_flag_owned;
    }

    /// A flusher's claim of dirty slots (`Buffer.take_dirty`), counted as this process's uses
    /// like any other reference, so the queue's Gets of the same keys see them held.
    pub fn take_dirty(queue: *Queue, cursor: *u32, out: Buffer.DirtyOutput) u32 {
        if (queue.buffer == null) return 0; // no slots, no debt
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        const taken = queue.buffer.?.take_dirty(cursor, out);
        for (out.slots[0..taken]) |slot| {
            // take_dirty skips slots this holder references: no local use yet.
            assert(queue.uses[slot] == 0);
            queue.uses[slot] = 1;
            queue.claimed += 1;
            queue.local_flags[slot] = local_flag_ready;
        }
        return taken;
    }

    /// Admission's claim (`Buffer.admit`), its references counted as this process's uses like
    /// a flusher's claim; released with `release_taken`. Returns how many were admitted.
    pub fn take_admitted(queue: *Queue, ids: []const BlockId, shards: []const u32, rule: Buffer.AdmitRule, slots: []u32) u32 {
        assert(ids.len == shards.len and slots.len == ids.len);
        if (queue.buffer == null) {
            @memset(slots, buffer_module.slot_none); // no slots, no reuse counts
            return 0;
        }
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        const admitted = queue.buffer.?.admit(ids, shards, rule, slots);
        for (slots) |slot| {
            if (slot == buffer_module.slot_none) continue;
            // admit skips slots this holder references: no local use yet.
            assert(queue.uses[slot] == 0);
            queue.uses[slot] = 1;
            queue.claimed += 1;
            queue.local_flags[slot] = local_flag_ready;
        }
        return admitted;
    }

    /// Clears the admitted bit for lower tier `tier` of slots this process holds (taken with
    /// `take_admitted`, not yet released) whose write to the tier failed, so a later check
    /// admits them again (`Buffer.unadmit`). Null, and nothing cleared, when a slot is not
    /// one this process holds.
    pub fn unadmit(queue: *Queue, slots: []const u32, tier: u32) ?u32 {
        if (queue.buffer == null) return if (slots.len == 0) 0 else null; // nothing taken
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        for (slots) |slot| {
            if (slot >= queue.uses.len or queue.uses[slot] == 0) return null;
        }
        return queue.buffer.?.unadmit(slots, tier);
    }

    /// Drops references the caller took through `take_dirty` (validated: never more uses than
    /// the caller holds). False, and nothing released, when the list is not valid.
    pub fn release_taken(queue: *Queue, slots: []u32) bool {
        {
            queue.refs_mutex.lock();
            defer queue.refs_mutex.unlock();
            for (slots, 0..) |slot, i| {
                if (slot >= queue.uses.len) return false;
                var listed: u32 = 0;
                for (slots[0 .. i + 1]) |other| listed += @intFromBool(other == slot);
                if (listed > queue.uses[slot]) return false;
            }
        }
        queue.release_slots(slots);
        return true;
    }

    /// Pins: takes this process's reference on each key that is Ready in the buffer and keeps
    /// it, counted as a local use like a flusher's claim (so the queue's own Gets of the key
    /// see it held), until `release_taken`. A referenced slot is never an eviction victim, so
    /// a pinned shard stays until it is released (or force-removed). A key not Ready here gets
    /// `slot_none` and nothing is held: a pin never allocates a slot nor starts a load.
    /// Returns how many keys were pinned.
    pub fn pin(queue: *Queue, ids: []const BlockId, shards: []const u32, slots: []u32) u32 {
        assert(ids.len == shards.len and slots.len == ids.len);
        if (queue.buffer == null) {
            // A null buffer holds no slot: nothing can be pinned.
            @memset(slots, buffer_module.slot_none);
            return 0;
        }
        const step = 64;
        var pinned: u32 = 0;
        var start: usize = 0;
        while (start < ids.len) {
            const end = @min(ids.len, start + step);
            const n = end - start;
            @memset(slots[start..end], buffer_module.slot_none);
            var ready: [step]u8 = undefined;
            // A bucket lock held past the timeout: nothing of this step is pinned.
            queue.buffer.?.lookup(ids[start..end], shards[start..end], ready[0..n]) catch @memset(ready[0..n], 0);
            // Claim the Ready keys only, so that no slot is allocated for an absent one.
            var claim_ids: [step]BlockId = undefined;
            var claim_shards: [step]u32 = undefined;
            var position: [step]usize = undefined;
            var k: usize = 0;
            for (ready[0..n], start..) |present, index| {
                if (present == 0) continue;
                claim_ids[k] = ids[index];
                claim_shards[k] = shards[index];
                position[k] = index;
                k += 1;
            }
            var results: [step]GetResult = undefined;
            var claimed: [step]u32 = undefined;
            queue.claim(.claim, claim_ids[0..k], claim_shards[0..k], results[0..k], claimed[0..k]);
            var drop: [step]u32 = undefined;
            var dropped: usize = 0;
            var hits: u32 = 0;
            for (results[0..k], claimed[0..k], position[0..k]) |result, slot, index| {
                switch (result) {
                    .hit => {
                        slots[index] = slot;
                        hits += 1;
                    },
                    // Evicted (and taken again) between the lookup and the claim: give it back
                    // (an owner gives up, its waiters take over).
                    .owner, .waiter => {
                        drop[dropped] = slot;
                        dropped += 1;
                    },
                    .held => unreachable, // Resolved by `claim`.
                    .absent => unreachable, // A `.claim` claim.
                    .no_slot, .lock_timeout => {},
                }
            }
            queue.release_slots(drop[0..dropped]);
            queue.refs_mutex.lock();
            queue.pinned += hits;
            queue.refs_mutex.unlock();
            pinned += hits;
            start = end;
        }
        return pinned;
    }

    /// Drops pins taken with `pin` (validated like `release_taken`, and never more than are
    /// pinned). False, and nothing released, when the list is not valid.
    pub fn unpin(queue: *Queue, slots: []u32) bool {
        {
            queue.refs_mutex.lock();
            defer queue.refs_mutex.unlock();
            if (slots.len > queue.pinned) return false;
            queue.pinned -= @intCast(slots.len);
        }
        if (queue.release_taken(slots)) return true;
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        queue.pinned += @intCast(slots.len);
        return false;
    }

    /// Slots this process holds through the queue (tests and the leak check at close).
    pub fn held_slot_count(queue: *Queue) u32 {
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        var held: u32 = 0;
        for (queue.uses) |uses| held += @intFromBool(uses > 0);
        assert(held == queue.claimed);
        return held;
    }

    pub fn slot_address_of(queue: *const Queue, slot: u32) usize {
        assert(slot < queue.buffer.?.slots.len);
        return queue.slot_address(slot);
    }

    fn slot_address(queue: *const Queue, slot: u32) usize {
        const location = queue.buffer.?.slot_location(slot);
        const base = queue.segment_bases[location.segment];
        assert(base != 0);
        return base + @as(usize, @intCast(location.offset_bytes));
    }

    /// Faults the slot's pages in before it is written: a shortage is an errno here.
    fn ensure_resident(queue: *Queue, slot: u32) bool {
        const populater = queue.populater orelse return true;
        const err = populater.ensure(queue.slot_address(slot), @intCast(queue.settings.shard_size_bytes));
        if (err == .SUCCESS) return true;
        queue.count(.no_memory, 1);
        return false;
    }

    // ---------------------------------------------------------------------------------------
    // Dispatchers.

    fn dispatch_loop(queue: *Queue, lane_index: u32) void {
        seg_sys.block_signals();
        const lane = &queue.lanes[lane_index];
        var tasks: u64 = 0;
        while (tasks < std.math.maxInt(u64)) : (tasks += 1) {
            const task_index = queue.pop_task(lane) orelse return;
            const task = &queue.tasks[task_index];
            switch (task.kind) {
                .load, .prefetch => queue.dispatch_load(lane, task_index),
                .dump => queue.dispatch_dump(lane, task_index),
            }
        }
    }

    fn pop_task(queue: *Queue, lane: *Lane) ?u32 {
        queue.mutex.lock();
        defer queue.mutex.unlock();
        var rounds: u64 = 0;
        while (lane.count == 0) : (rounds += 1) {
            assert(rounds < std.math.maxInt(u64));
            if (queue.stopping) return null;
            lane.not_empty.wait(&queue.mutex);
        }
        const index = lane.pending[lane.head];
        lane.head = (lane.head + 1) % @as(u32, lane.pending.len);
        lane.count -= 1;
        queue.space.broadcast(); // submitters of every lane wait on this one condition
        return index;
    }

    fn lane_idle(queue: *Queue, lane: *const Lane) bool {
        queue.mutex.lock();
        defer queue.mutex.unlock();
        return lane.count == 0;
    }

    fn walk_of(queue: *const Queue, n: u32) Walk {
        const rearrange = queue.settings.flags & settings_flag_rearrange != 0;
        return walk_order(n, queue.settings.device_id, queue.settings.local_rank_size, rearrange);
    }

    /// Top-tier dumps of a stack without a buffer (Python writes them into the top tier),
    /// counted here so that the queue's counters are the stack's one set of load/dump counters.
    pub fn count_dumps(queue: *Queue, dumped: u64, failed: u64) void {
        assert(queue.buffer == null);
        queue.count(.dumped_shards, dumped);
        queue.count(.failed_shards, failed);
    }

    fn dispatch_load(queue: *Queue, lane: *Lane, task_index: u32) void {
        const task = &queue.tasks[task_index];
        const n = task.entry_count;
        const limit = queue.step_limit();
        const walk = queue.walk_of(n);
        for (walk.pieces[0..walk.piece_count]) |piece| {
            // Each piece is cut into steps of at most `limit` keys.
            var position = piece.start;
            var steps: u32 = 0;
            while (position < piece.end) : (steps += 1) {
                assert(steps <= n);
                var k: u32 = 0;
                while (k < limit and position < piece.end) : (k += 1) {
                    lane.entries[k] = position;
                    position += piece.stride;
                }
                queue.load_step(lane, task_index, lane.entries[0..k]);
            }
        }
        // Idle window (seed 3.4): prewarm (block, index + 1) of this task's blocks when no
        // task waits. The keys are copied first: the task may complete as soon as the
        // dispatcher lets go of it, and its arrays are the caller's.
        var prewarm_count: u32 = 0;
        if (task.kind == .load and queue.buffer != null and queue.settings.flags & settings_flag_prealloc != 0) {
            var entry: u32 = 0;
            while (entry < n and prewarm_count < lane.ids.len) : (entry += 1) {
                const next = task.shards[entry] + 1;
                if (next >= queue.settings.shards_per_block) continue;
                lane.ids[prewarm_count] = task.ids[entry];
                lane.shards[prewarm_count] = next;
                prewarm_count += 1;
            }
        }
        queue.release_task(task_index);
        if (prewarm_count > 0 and queue.lane_idle(lane)) {
            const outcomes: []buffer_module.PreallocResult = @ptrCast(lane.results[0..prewarm_count]);
            queue.buffer.?.prealloc(lane.ids[0..prewarm_count], lane.shards[0..prewarm_count], outcomes);
            var allocated: u64 = 0;
            for (outcomes) |outcome| allocated += @intFromBool(outcome == .allocated);
            queue.count(.prewarmed, allocated);
        }
    }

    /// A step holds a reference on every slot it claims: half the regular pool at most, so a
    /// task larger than the buffer still finds free slots.
    fn step_limit(queue: *const Queue) u32 {
        const buffer = queue.buffer orelse return queue.settings.step_keys;
        const half = @max(1, buffer.geometry.slot_count_regular / 2);
        return @max(1, @min(queue.settings.step_keys, half));
    }

    fn begin_step(lane: *Lane) u32 {
        const previous = lane.step_word.load(.monotonic);
        const step: u32 = @as(u32, @intCast(previous >> 32)) +% 1;
        // Release: a loader that reads the word sees the step as begun.
        lane.step_word.store(@as(u64, step) << 32, .release);
        return step;
    }

    fn add_outstanding(lane: *Lane, step: u32, amount: u32) void {
        if (amount == 0) return;
        // AcqRel: orders with the loaders' decrements; only the dispatcher adds, for its step.
        const previous = lane.step_word.fetchAdd(amount, .acq_rel);
        assert(@as(u32, @intCast(previous >> 32)) == step);
    }

    /// A loader filled one owned key of `step`: counts it down if the step is still current.
    fn fill_returned(lane: *Lane, step: u32) void {
        var attempts: u32 = 0;
        while (attempts < constants.buffer_cas_attempts_max * 64) : (attempts += 1) {
            const word = lane.step_word.load(.acquire);
            if (@as(u32, @intCast(word >> 32)) != step) return; // the dispatcher moved on
            const outstanding: u32 = @truncate(word);
            assert(outstanding > 0);
            // AcqRel: the dispatcher's acquire load sees the fill's commit.
            if (lane.step_word.cmpxchgWeak(word, word - 1, .acq_rel, .acquire) == null) {
                if (outstanding == 1) {
                    _ = lane.step_wake.fetchAdd(1, .release);
                    _ = futex.wake_all(&lane.step_wake);
                }
                return;
            }
        }
        unreachable; // The only other writers are loaders decrementing: the CAS succeeds soon.
    }

    fn wait_step(queue: *Queue, lane: *Lane, deadline_ns: u64) void {
        var rounds: u64 = 0;
        while (rounds < std.math.maxInt(u32)) : (rounds += 1) {
            // Read the wake word before the count: a fill between the two changes the word.
            const wake = lane.step_wake.load(.acquire);
            if (@as(u32, @truncate(lane.step_word.load(.acquire))) == 0) return;
            const now_ns = futex.monotonic_ns();
            if (now_ns >= deadline_ns or queue.stop_requested()) return;
            _ = futex.wait(&lane.step_wake, wake, @min(deadline_ns - now_ns, constants.queue_ring_wait_slice_ns));
        }
    }

    /// Whether teardown began (threads give up their bounded waits early).
    fn stop_requested(queue: *const Queue) bool {
        // Monotonic: a standalone flag; the mutex orders the rest of teardown.
        return queue.stop_flag.load(.monotonic);
    }

    fn load_step(queue: *Queue, lane: *Lane, task_index: u32, entries: []const u32) void {
        const task = &queue.tasks[task_index];
        const k = entries.len;
        assert(k > 0 and k <= lane.ids.len);
        for (entries, 0..) |entry, i| {
            lane.ids[i] = task.ids[entry];
            lane.shards[i] = task.shards[entry];
        }
        if (queue.buffer == null) {
            // Null buffer: no slot to claim, every key is loaded from below by a loader. The
            // step ends when they are loaded (or wait_timeout passed), as a buffer's step ends
            // when its owned keys are filled: the lane's depth then bounds the tasks in flight.
            const step = begin_step(lane);
            const started_ns = futex.monotonic_ns();
            const keys: u32 = @intCast(k);
            add_outstanding(lane, step, keys);
            const parts = @min(queue.settings.fill_parts, keys);
            for (entries, 0..) |entry, i| {
                queue.bypass(task_index, entry, step, part_ends(@intCast(i + 1), keys, parts));
            }
            queue.wait_step(lane, started_ns +| queue.settings.wait_timeout_ns);
            return;
        }
        const results = lane.results[0..k];
        const slots = lane.slots[0..k];
        queue.wait_room(k);
        const step = begin_step(lane);
        const started_ns = futex.monotonic_ns();
        const no_fill = task.flags & task_flag_no_fill != 0;
        // A no-fill load only looks its keys up: a key it cannot copy is missing, so a slot
        // claimed for it (a CLOCK victim in a full buffer) would evict a Ready block for nothing.
        const mode: GetMode = if (no_fill) .lookup else .claim;
        // Claimed in pieces, hits handed on after each: the copy threads start on the first
        // piece's hits while the rest of the step is claimed.
        var hits: u64 = 0;
        var piece_start: usize = 0;
        while (piece_start < k) {
            const piece_end = @min(k, piece_start + constants.queue_claim_piece_keys);
            queue.claim(mode, lane.ids[piece_start..piece_end], lane.shards[piece_start..piece_end], results[piece_start..piece_end], slots[piece_start..piece_end]);
            for (entries[piece_start..piece_end], results[piece_start..piece_end], slots[piece_start..piece_end]) |entry, result, slot| {
                if (result != .hit) continue;
                hits += 1;
                queue.entry_ready(task_index, entry, slot, false);
            }
            piece_start = piece_end;
        }
        // Owned keys: to the loaders in `fill_parts` batches (concurrent loads below). Those
        // that cannot be filled here are finished first, so the batches are cut exactly.
        var owned: u32 = 0;
        for (entries, results, slots) |entry, *result, slot| {
            if (result.* == .absent) {
                assert(no_fill and slot == buffer_module.slot_none);
                queue.finish_entry(task_index, entry, .missing);
                continue;
            }
            if (result.* != .owner) continue;
            assert(!no_fill); // A lookup owns nothing.
            queue.count(.owned, 1);
            if (!queue.ensure_resident(slot)) {
                _ = queue.commit(slot, .failed, false);
                queue.release_one(slot);
                queue.finish_entry(task_index, entry, .no_memory);
                result.* = .held; // handled: skipped below
                continue;
            }
            owned += 1;
        }
        add_outstanding(lane, step, owned);
        const parts = @min(queue.settings.fill_parts, @max(owned, 1));
        var pushed: u32 = 0;
        for (entries, results, slots) |entry, result, slot| {
            if (result != .owner) continue;
            pushed += 1;
            const batch_end = part_ends(pushed, owned, parts);
            queue.push_work(.{ .task = task_index, .entry = entry, .slot = slot, .step = step, .kind = .fill, .batch_end = batch_end });
        }
        assert(pushed == owned);
        // Keys that got no slot: loaded from below straight into the destination.
        var bypass_count: u32 = 0;
        for (results) |result| bypass_count += @intFromBool(result == .no_slot or result == .lock_timeout);
        const bypass_parts = @min(queue.settings.fill_parts, @max(bypass_count, 1));
        var bypassed: u32 = 0;
        for (entries, results) |entry, result| {
            if (result != .no_slot and result != .lock_timeout) continue;
            bypassed += 1;
            queue.bypass(task_index, entry, step, part_ends(bypassed, bypass_count, bypass_parts));
        }
        // Waiters: sleep on each slot's futex, one deadline for the step. A prefetch does not
        // wait: whoever fills the slot brings the key up anyway. A no-wait load does not
        // either: the key is not Ready here, so it is missing.
        var waited: u64 = 0;
        const deadline_ns = started_ns +| queue.settings.wait_timeout_ns;
        const no_wait = task.flags & task_flag_no_wait != 0;
        assert(!no_wait or no_fill);
        for (entries, results, slots) |entry, result, slot| {
            if (result != .waiter) continue;
            if (no_wait) {
                queue.release_one(slot);
                queue.finish_entry(task_index, entry, .missing);
                continue;
            }
            waited += 1;
            if (task.kind == .prefetch) {
                queue.release_one(slot);
                queue.finish_entry(task_index, entry, .ok);
                continue;
            }
            if (queue.resolve_waiter(lane, step, task_index, entry, slot, deadline_ns)) hits += 1;
        }
        queue.count(.waited, waited);
        if (task.kind == .load) {
            queue.count(.hits, hits);
            queue.count(.misses, k - hits);
        }
        queue.wait_step(lane, deadline_ns);
    }

    /// Whether item `position` (1-based) of `total` ends one of `parts` near-equal pieces.
    fn part_ends(position: u32, total: u32, parts: u32) bool {
        assert(position >= 1 and position <= total);
        assert(parts >= 1 and parts <= total);
        if (position == total) return true;
        var part: u32 = 1;
        while (part < parts) : (part += 1) {
            const boundary = (@as(u64, total) * part + parts - 1) / parts;
            if (boundary == position) return true;
        }
        return false;
    }

    /// A Ready slot this entry holds: copied by the copy threads, by the caller (caller copy),
    /// or, for a prefetch, simply released. `from_loader`: called by a loader's report, which
    /// must not block on the work ring it drains itself.
    fn entry_ready(queue: *Queue, task_index: u32, entry: u32, slot: u32, from_loader: bool) void {
        const task = &queue.tasks[task_index];
        if (task.kind == .prefetch) {
            queue.release_one(slot);
            queue.finish_entry(task_index, entry, .ok);
            return;
        }
        if (task.entry_flags) |flags| {
            if (flags[entry] & entry_flag_caller_copy != 0) {
                const item: WorkItem = .{ .task = task_index, .entry = entry, .slot = slot, .step = 0, .kind = .copy_out, .batch_end = true };
                if (!from_loader) {
                    queue.push_work(item);
                } else if (!queue.try_push_work(item, constants.queue_ring_wait_slice_ns)) {
                    queue.release_one(slot);
                    queue.finish_entry(task_index, entry, .backlog);
                }
                return;
            }
        }
        queue.push_copy(.{ .task = task_index, .entry = entry, .slot = slot });
    }

    fn bypass(queue: *Queue, task_index: u32, entry: u32, step: u32, batch_end: bool) void {
        const task = &queue.tasks[task_index];
        queue.count(.bypassed, 1);
        if (task.flags & task_flag_no_fill != 0) {
            queue.finish_entry(task_index, entry, .missing);
        } else if (task.kind == .prefetch and queue.buffer != null) {
            // Without a slot a prefetch has nowhere to put the bytes.
            queue.finish_entry(task_index, entry, .ok);
        } else {
            queue.push_work(.{ .task = task_index, .entry = entry, .slot = buffer_module.slot_none, .step = step, .kind = .bypass, .batch_end = batch_end });
        }
    }

    /// Waits for one slot another rank (or this one) fills. Returns whether it became a hit.
    fn resolve_waiter(queue: *Queue, lane: *Lane, step: u32, task_index: u32, entry: u32, slot: u32, deadline_ns: u64) bool {
        const started_ns = futex.monotonic_ns();
        defer queue.count_max(.wait_ns_max, futex.monotonic_ns() - started_ns);
        const task = &queue.tasks[task_index];
        var rounds: u32 = 0;
        var step_deadline_ns = deadline_ns;
        var slices: u64 = 0;
        while (rounds <= constants.queue_wait_rounds_max) : (slices += 1) {
            assert(slices < std.math.maxInt(u32));
            var out = [1]WaitResult{.idle};
            const now_ns = futex.monotonic_ns();
            // In slices, so that teardown never waits out a whole wait_timeout.
            const remaining_ns = step_deadline_ns -| now_ns;
            const slice_ns = @min(remaining_ns, constants.futex_wait_slice_ns);
            queue.buffer.?.wait(&.{slot}, slice_ns, &out);
            if (out[0] == .idle and slice_ns < remaining_ns and !queue.stop_requested()) continue;
            switch (out[0]) {
                .ready => {
                    queue.set_ready(slot);
                    queue.entry_ready(task_index, entry, slot, false);
                    return true;
                },
                .failed, .missing => {
                    queue.release_one(slot);
                    queue.finish_entry(task_index, entry, if (out[0] == .failed) .owner_failed else .owner_missing);
                    return false;
                },
                .takeover => {
                    // The owner died: this rank loads it now.
                    queue.count(.takeovers, 1);
                    queue.mark_owned(slot);
                    if (task.flags & task_flag_no_fill != 0) {
                        _ = queue.commit(slot, .missing, false);
                        queue.release_one(slot);
                        queue.finish_entry(task_index, entry, .missing);
                    } else if (!queue.ensure_resident(slot)) {
                        _ = queue.commit(slot, .failed, false);
                        queue.release_one(slot);
                        queue.finish_entry(task_index, entry, .no_memory);
                    } else {
                        add_outstanding(lane, step, 1);
                        queue.push_work(.{ .task = task_index, .entry = entry, .slot = slot, .step = step, .kind = .fill, .batch_end = true });
                    }
                    return false;
                },
                .idle, .lock_timeout => {
                    // A thread of this process is filling it: waiting longer is the only
                    // option (giving it up would hand the slot to another owner mid-fill).
                    if (out[0] == .idle and rounds < constants.queue_wait_rounds_max and queue.locally_owned(slot) and !queue.stop_requested()) {
                        step_deadline_ns = futex.monotonic_ns() +| queue.settings.wait_timeout_ns;
                        rounds += 1;
                        continue;
                    }
                    // Timed out behind a live owner, or lock trouble: load it here, from below.
                    if (out[0] == .idle) queue.count(.wait_timeouts, 1);
                    queue.release_one(slot);
                    queue.bypass(task_index, entry, step, true);
                    return false;
                },
            }
        }
        unreachable;
    }

    fn set_ready(queue: *Queue, slot: u32) void {
        queue.refs_mutex.lock();
        defer queue.refs_mutex.unlock();
        assert(queue.uses[slot] > 0);
        queue.local_flags[slot] |= local_flag_ready;
    }

    fn push_work(queue: *Queue, item: WorkItem) void {
        const pushed = queue.try_push_work(item, std.math.maxInt(u64));
        assert(pushed);
    }

    fn try_push_work(queue: *Queue, item: WorkItem, timeout_ns: u64) bool {
        var stamped = item;
        stamped.generation = queue.tasks[item.task].generation;
        assert(queue.tasks[item.task].live);
        queue.count(.work_items, 1);
        return queue.work.try_push(stamped, timeout_ns);
    }

    fn push_copy(queue: *Queue, item: CopyItem) void {
        var stamped = item;
        stamped.generation = queue.tasks[item.task].generation;
        assert(queue.tasks[item.task].live);
        queue.copies.push(stamped);
    }

    fn dispatch_dump(queue: *Queue, lane: *Lane, task_index: u32) void {
        const task = &queue.tasks[task_index];
        const n = task.entry_count;
        const limit = queue.step_limit();
        var position: u32 = 0;
        var steps: u32 = 0;
        while (position < n) : (steps += 1) {
            assert(steps <= n);
            const k = @min(limit, n - position);
            for (0..k) |i| lane.entries[i] = position + @as(u32, @intCast(i));
            queue.dump_step(lane, task_index, lane.entries[0..k]);
            position += k;
        }
        queue.release_task(task_index);
    }

    /// One step of a dump task, in at most `queue_dump_rounds_max` claims of its keys. A key
    /// this rank owns is copied in and committed Ready. A key already Ready is replaced: removed
    /// (unless in use: then it keeps its equal bytes) and claimed again in the next round. A key
    /// another load is filling (any rank's, this one's included) waits for that fill's outcome:
    /// Ready is the same block, already in a tier (done); Failed or Missing leaves the key in no
    /// tier, so the dump claims it again and writes its own bytes; a dead filler's slot is taken
    /// over and written here. A fill still running after `wait_timeout` (one deadline per round
    /// for all its waiters), or a key whose fills kept failing, is NO_SLOT: the store writes it
    /// straight down, as for a full buffer. So a step waits at most `queue_dump_rounds_max`
    /// times `wait_timeout` for other loads' fills.
    fn dump_step(queue: *Queue, lane: *Lane, task_index: u32, entries: []const u32) void {
        const task = &queue.tasks[task_index];
        assert(entries.len > 0 and entries.len <= lane.entries.len);
        assert(entries.ptr == lane.entries.ptr); // Later rounds reuse the entries scratch.
        var k = entries.len;
        var round: u32 = 0;
        while (k > 0) : (round += 1) {
            assert(round < constants.queue_dump_rounds_max);
            const first = round == 0;
            const last = round + 1 == constants.queue_dump_rounds_max;
            const pending = lane.entries[0..k];
            for (pending, 0..) |entry, i| {
                lane.ids[i] = task.ids[entry];
                lane.shards[i] = task.shards[entry];
            }
            // Remove what nobody uses (a Ready copy this dump replaces), then claim afresh; a
            // key still in use keeps its (equal) bytes. Keys of failed fills are detached
            // already, so this removes nothing of theirs.
            if (!first) _ = queue.buffer.?.remove(lane.ids[0..k], lane.shards[0..k], false) catch 0;
            queue.wait_room(k);
            const results = lane.results[0..k];
            const slots = lane.slots[0..k];
            queue.claim(.write, lane.ids[0..k], lane.shards[0..k], results, slots);
            var again: usize = 0;
            // Owned keys first: their copies start (and a duplicate key of this task, which
            // waits on its first entry's slot below, finds that copy already queued).
            for (pending, results, slots) |entry, result, slot| {
                switch (result) {
                    .owner => queue.dump_owned(task_index, entry, slot),
                    .hit => {
                        queue.release_one(slot);
                        if (first and !last) {
                            lane.again[again] = entry;
                            again += 1;
                        } else {
                            // Ready again after a removal: another writer of the same block.
                            queue.finish_entry(task_index, entry, .ok);
                            queue.count(.dumped_shards, 1);
                        }
                    },
                    .waiter => {}, // Below, once every owned key's copy is queued.
                    .no_slot => queue.finish_entry(task_index, entry, .no_slot),
                    .lock_timeout => queue.finish_entry(task_index, entry, .lock_timeout),
                    .held => unreachable, // Resolved by `claim`.
                    .absent => unreachable, // A `.claim` claim.
                }
            }
            // One deadline for the round's waiters, as for a load step's: a step of many keys
            // behind slow fills waits `wait_timeout` per round, not per key.
            const deadline_ns = futex.monotonic_ns() +| queue.settings.wait_timeout_ns;
            for (pending, results, slots) |entry, result, slot| {
                if (result != .waiter) continue;
                switch (queue.dump_wait(slot, deadline_ns)) {
                    .ready => {
                        queue.release_one(slot);
                        queue.finish_entry(task_index, entry, .ok);
                        queue.count(.dumped_shards, 1);
                    },
                    .failed, .missing => {
                        // The fill left the key in no tier: this dump's bytes are the only copy.
                        queue.release_one(slot);
                        queue.count(.dump_refills, 1);
                        if (last) {
                            queue.finish_entry(task_index, entry, .no_slot);
                        } else {
                            lane.again[again] = entry;
                            again += 1;
                        }
                    },
                    .takeover => {
                        // The filler died: the slot is this rank's now, and gets the dump's bytes.
                        queue.count(.takeovers, 1);
                        queue.mark_owned(slot);
                        queue.dump_owned(task_index, entry, slot);
                    },
                    .idle => {
                        queue.count(.wait_timeouts, 1);
                        queue.release_one(slot);
                        queue.finish_entry(task_index, entry, .no_slot);
                    },
                    .lock_timeout => {
                        queue.release_one(slot);
                        queue.finish_entry(task_index, entry, .lock_timeout);
                    },
                }
            }
            assert(again <= k);
            // The next round's keys: `pending` is done with, its scratch is reused.
            for (lane.again[0..again], 0..) |entry, i| lane.entries[i] = entry;
            k = again;
        }
    }

    /// Waits until `deadline_ns` for the outcome of another load's fill of a slot a dump met
    /// (in futex slices, so that teardown never waits out the whole timeout). Past the
    /// deadline it still looks once: a final state, or a dead filler to take over.
    fn dump_wait(queue: *Queue, slot: u32, deadline_ns: u64) WaitResult {
        const started_ns = futex.monotonic_ns();
        defer queue.count_max(.wait_ns_max, futex.monotonic_ns() - started_ns);
        queue.count(.waited, 1);
        assert(deadline_ns <= started_ns +| queue.settings.wait_timeout_ns);
        const slices_max = queue.settings.wait_timeout_ns / constants.futex_wait_slice_ns + 2;
        var slices: u64 = 0;
        while (slices < slices_max) : (slices += 1) {
            var out = [1]WaitResult{.idle};
            const remaining_ns = deadline_ns -| futex.monotonic_ns();
            const slice_ns = @min(remaining_ns, constants.futex_wait_slice_ns);
            queue.buffer.?.wait(&.{slot}, slice_ns, &out);
            if (out[0] == .idle and slice_ns < remaining_ns and !queue.stop_requested()) continue;
            return out[0];
        }
        return .idle;
    }

    fn dump_owned(queue: *Queue, task_index: u32, entry: u32, slot: u32) void {
        if (!queue.ensure_resident(slot)) {
            _ = queue.commit(slot, .failed, false);
            queue.release_one(slot);
            queue.finish_entry(task_index, entry, .no_memory);
            return;
        }
        queue.push_copy(.{ .task = task_index, .entry = entry, .slot = slot });
    }

    // ---------------------------------------------------------------------------------------
    // Copy threads.

    fn copy_loop(queue: *Queue) void {
        seg_sys.block_signals();
        var batch: [constants.queue_copy_batch_items]CopyItem = undefined;
        var slots: [constants.queue_copy_batch_items]u32 = undefined;
        var loads: [constants.queue_copy_batch_items]CopyItem = undefined;
        var batches: u64 = 0;
        while (batches < std.math.maxInt(u64)) : (batches += 1) {
            const taken = queue.take_copies(&batch);
            if (taken == 0) return;
            const started_ns = futex.monotonic_ns();
            var load_count: usize = 0;
            var background = false;
            for (batch[0..taken]) |item| {
                const task = &queue.tasks[item.task];
                // An item never outlives its task: its entry holds one count of `remaining`.
                assert(task.live and task.generation == item.generation);
                if (task.kind == .dump or task.flags & task_flag_background != 0) background = true;
                if (task.kind == .dump) {
                    // Finishes its entry: the task (and its record) may be gone after this.
                    queue.copy_dump(item);
                } else {
                    queue.copy_load(item);
                    slots[load_count] = item.slot;
                    loads[load_count] = item;
                    load_count += 1;
                }
            }
            queue.count(.copy_ns, futex.monotonic_ns() - started_ns);
            queue.count(.copy_bytes, taken * queue.settings.shard_size_bytes);
            // Released before the entries finish: a finished task's caller may reuse the keys.
            queue.release_slots(slots[0..load_count]);
            queue.count(.loaded_shards, load_count);
            for (loads[0..load_count]) |item| queue.finish_entry(item.task, item.entry, .ok);
            // A copy thread with a long run of items never blocks between batches, and the
            // kernel lets it run a whole time slice (1.5 ms or more) before a thread of the
            // engine that spins with sched_yield (vLLM's scheduler process waiting on its
            // workers, OpenMP threads at a barrier) gets the CPU back: the engine's step
            // waits that long. Yielding after each batch (one shard, or several up to
            // `queue_copy_batch_bytes`: ~0.2 ms for a 2 MiB shard) bounds that wait; with
            // nothing else runnable it costs one system call. Measured with
            // `harness.slow_tier_tpot`: the decoder's steps during an async load went from
            // 1.24-1.34x to 0.97-1.23x its undisturbed figure (3 interleaved pairs).
            // Only for copies nobody waits on (dumps, background loads): beside CPU-bound
            // processes each yield hands over a whole slice, and a 256 MiB load took 60 ms
            // instead of 20-28 ms; a load the engine waits on must not pay that.
            if (background) std.Thread.yield() catch {};
        }
    }

    /// Takes up to `queue_copy_batch_bytes` of copies (at least one item); 0 when stopped.
    fn take_copies(queue: *Queue, batch: []CopyItem) usize {
        const ring = &queue.copies;
        ring.mutex.lock();
        defer ring.mutex.unlock();
        var rounds: u64 = 0;
        while (!ring.wait_item_locked(constants.queue_ring_wait_slice_ns)) : (rounds += 1) {
            assert(rounds < std.math.maxInt(u64));
            if (ring.stopped) return 0;
        }
        var taken: usize = 0;
        var bytes: u64 = 0;
        while (ring.count > 0 and taken < batch.len and (taken == 0 or bytes < constants.queue_copy_batch_bytes)) {
            batch[taken] = ring.pop_locked();
            taken += 1;
            bytes += queue.settings.shard_size_bytes;
        }
        // More left: another copy thread may take it now.
        if (ring.count > 0) ring.not_empty.signal();
        return taken;
    }

    fn copy_load(queue: *Queue, item: CopyItem) void {
        const task = &queue.tasks[item.task];
        const addresses = task.addresses.?;
        const tensors = queue.settings.tensor_count;
        var source = queue.slot_address(item.slot);
        const first = @as(usize, item.entry) * tensors;
        for (queue.tensor_sizes, 0..) |size, j| {
            copy_bytes(@intCast(addresses[first + j]), source, @intCast(size));
            source += @intCast(size);
        }
        store_fence();
    }

    fn copy_dump(queue: *Queue, item: CopyItem) void {
        const task = &queue.tasks[item.task];
        const addresses = task.addresses.?;
        const tensors = queue.settings.tensor_count;
        var target = queue.slot_address(item.slot);
        const first = @as(usize, item.entry) * tensors;
        for (queue.tensor_sizes, 0..) |size, j| {
            copy_bytes(target, @intCast(addresses[first + j]), @intCast(size));
            target += @intCast(size);
        }
        store_fence(); // the commit's release store publishes the bytes
        const committed = queue.commit(item.slot, .ready, task.flags & task_flag_dirty != 0);
        queue.release_one(item.slot);
        if (committed) queue.count(.dumped_shards, 1);
        queue.finish_entry(item.task, item.entry, if (committed) .ok else .lock_timeout);
    }

    // ---------------------------------------------------------------------------------------
    // The caller's loaders.

    /// Takes one batch of work (at most `out.len` items of one task and kind), waiting up to
    /// `timeout_ns`. 0 when none came; null when the queue stopped and the ring is empty.
    pub fn next_work(queue: *Queue, timeout_ns: u64, out: []WorkItem) ?usize {
        assert(out.len > 0);
        const ring = &queue.work;
        ring.mutex.lock();
        defer ring.mutex.unlock();
        if (!ring.wait_item_locked(timeout_ns)) {
            return if (ring.stopped and ring.count == 0) null else 0;
        }
        var taken: usize = 0;
        while (ring.count > 0 and taken < out.len) {
            const item = ring.pop_locked();
            out[taken] = item;
            taken += 1;
            if (item.batch_end) break;
        }
        return taken;
    }

    pub const Report = struct {
        token: u64,
        entry: u32,
        slot: u32,
        step: u32,
        kind: WorkKind,
        state: WorkState,
    };

    /// Checks a loader's report against what the queue handed out (never trusts the caller)
    /// and, when it is valid, claims the entry for this report: a second report of the same
    /// item is refused. The caller then calls `work_done`.
    pub fn accept_report(queue: *Queue, report: Report) bool {
        const parts = token_parts(report.token);
        if (parts.index >= queue.tasks.len) return false;
        const task = &queue.tasks[parts.index];
        queue.mutex.lock();
        const live = task.live and task.generation == parts.generation;
        queue.mutex.unlock();
        if (!live) return false;
        if (report.entry >= task.entry_count) return false;
        // `hit` is a null buffer's bypass only: it says which tier served the key.
        if (report.state == .hit and (report.kind != .bypass or queue.buffer != null)) return false;
        switch (report.kind) {
            .bypass => if (report.slot != buffer_module.slot_none) return false,
            .fill, .copy_out => {
                if (queue.buffer == null) return false;
                if (report.slot >= queue.buffer.?.slots.len) return false;
                const slot = &queue.buffer.?.slots[report.slot];
                if (slot.shard_index != task.shards[report.entry]) return false;
                if (!std.mem.eql(u8, &slot.block_id, &task.ids[report.entry])) return false;
                queue.refs_mutex.lock();
                defer queue.refs_mutex.unlock();
                if (queue.uses[report.slot] == 0) return false;
                const owned = queue.local_flags[report.slot] & local_flag_owned != 0;
                if (owned != (report.kind == .fill)) return false;
            },
        }
        // AcqRel: one report wins the entry; the loser touches nothing.
        const result: *u8 = &task.results[report.entry];
        return @cmpxchgStrong(u8, result, @intFromEnum(EntryResult.pending), @intFromEnum(EntryResult.reported), .acq_rel, .monotonic) == null;
    }

    /// A loader finished one work item (accepted by `accept_report`).
    pub fn work_done(queue: *Queue, report: Report) void {
        const task_index = token_parts(report.token).index;
        const task = &queue.tasks[task_index];
        const entry = report.entry;
        assert(task.results[entry] == @intFromEnum(EntryResult.reported));
        switch (report.kind) {
            .fill => {
                const state: State = switch (report.state) {
                    .ready => .ready,
                    .failed => .failed,
                    .missing => .missing,
                    .hit => unreachable, // refused by `accept_report`
                };
                const committed = queue.commit(report.slot, state, false);
                // The step may end now: the owned key is published (or given up).
                fill_returned(&queue.lanes[lane_of(task.kind)], report.step);
                if (committed and state == .ready) {
                    if (task.kind == .prefetch) queue.count(.prefetched_shards, 1);
                    // The report is applied; the entry goes on (a copy, or a caller copy
                    // whose own report claims it again).
                    @atomicStore(u8, &task.results[entry], @intFromEnum(EntryResult.pending), .monotonic);
                    queue.entry_ready(task_index, entry, report.slot, true);
                    return;
                }
                queue.release_one(report.slot);
                queue.finish_entry(task_index, entry, if (committed) .caller_failed else .lock_timeout);
            },
            .bypass => {
                const loaded = report.state == .ready or report.state == .hit;
                if (queue.buffer == null) {
                    // Every key of a null buffer's step is outstanding until its report.
                    fill_returned(&queue.lanes[lane_of(task.kind)], report.step);
                    // The step counted nothing: the loader's report says which tier served it.
                    if (task.kind == .load) {
                        queue.count(if (report.state == .hit) .hits else .misses, 1);
                    } else if (report.state == .ready) {
                        queue.count(.prefetched_shards, 1); // brought up into the top tier
                    }
                }
                if (loaded and task.kind == .load) queue.count(.loaded_shards, 1);
                queue.finish_entry(task_index, entry, if (loaded) .ok else .caller_failed);
            },
            .copy_out => {
                queue.release_one(report.slot);
                if (report.state == .ready) queue.count(.loaded_shards, 1);
                queue.finish_entry(task_index, entry, if (report.state == .ready) .ok else .caller_failed);
            },
        }
    }
};

test "Ring.try_push: waits at most its timeout on a full ring; a stopped ring drops the item" {
    var items: [2]u32 = undefined;
    var ring: Ring(u32) = .{ .items = &items };
    ring.push(1);
    ring.push(2);
    try std.testing.expect(!ring.try_push(3, std.time.ns_per_ms));
    try std.testing.expectEqual(@as(usize, 2), ring.count);
    ring.mutex.lock();
    try std.testing.expectEqual(@as(u32, 1), ring.pop_locked());
    ring.mutex.unlock();
    try std.testing.expect(ring.try_push(3, std.time.ns_per_ms));
    ring.mutex.lock();
    try std.testing.expectEqual(@as(u32, 2), ring.pop_locked());
    try std.testing.expectEqual(@as(u32, 3), ring.pop_locked());
    ring.mutex.unlock();
    ring.stop();
    try std.testing.expect(ring.try_push(4, std.time.ns_per_ms));
    try std.testing.expectEqual(@as(usize, 0), ring.count);
}
