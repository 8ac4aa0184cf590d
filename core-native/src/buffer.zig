//! The CacheBuffer control plane (seed §3.2–3.4): everything every rank of a node shares to
//! decide which slot holds which shard, who loads it, and who waits for it.
//!
//! The control region is caller-provided memory (a shared mapping) laid out once by `init` and
//! validated by `attach`. It holds no pointers, only indices and offsets, so every process may
//! map it at a different address:
//!
//!   [Header][Clock][Counters][Bucket × bucket_count][Slot × (regular + reserved)]
//!
//! Locking: each hash bucket has a cross-process lock word holding the holder's pid. A slot's
//! key, chain link, refcount, owner and state transitions are changed only under the lock of the
//! bucket it is linked into. A free slot (`bucket == bucket_free`) is claimed with a CAS, a
//! slot detached from its chain (failed, or force-removed while in use) is only released.
//! Eviction holds the new key's bucket lock and only *tries* the victim's bucket lock, so two
//! bucket locks are never waited for at once and there is no lock-order deadlock.
//!
//! Data slots are addressed as segment_base[segment] + offset; `slot_location` computes the
//! pair with shift+mask when slots_per_segment is a power of two, else with div/mod.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const futex = @import("futex.zig");

const assert = std.debug.assert;
const Atomic = std.atomic.Value;

pub const slot_none: u32 = std.math.maxInt(u32);
/// `Slot.bucket` of a slot on no chain that nobody holds: claimable by CAS.
pub const bucket_free: u32 = std.math.maxInt(u32);
/// `Slot.bucket` of a slot unlinked while still referenced; freed by its last release.
pub const bucket_detached: u32 = std.math.maxInt(u32) - 1;

pub const block_id_size_bytes = 16;
pub const BlockId = [block_id_size_bytes]u8;

pub const State = enum(u32) { idle = 0, ready = 1, failed = 2 };

pub const slot_flag_reserved: u32 = 1 << 0;
pub const slot_flag_preallocated: u32 = 1 << 1;

const lock_contended_bit: u32 = 1 << 31;
const lock_pid_mask: u32 = lock_contended_bit - 1;

pub const Geometry = extern struct {
    shard_size_bytes: u64,
    slot_count_regular: u32,
    slot_count_reserved: u32,
    bucket_count: u32,
    slots_per_segment: u32,

    pub fn slot_count_total(geometry: Geometry) u32 {
        return geometry.slot_count_regular + geometry.slot_count_reserved;
    }

    pub fn segment_count(geometry: Geometry) u32 {
        assert(geometry.slots_per_segment > 0);
        return std.math.divCeil(u32, geometry.slot_count_total(), geometry.slots_per_segment) catch
            unreachable;
    }
};

pub const Header = extern struct {
    magic: Atomic(u64),
    layout_version: u32,
    header_size_bytes: u32,
    ctrl_size_bytes: u64,
    geometry: Geometry,
    segment_count: u32,
    /// log2(slots_per_segment) when it is a power of two, else `slot_none` (div/mod path).
    slots_per_segment_shift: u32,
    creator_pid: u32,
    _pad0: u32,
    creator_start_time: u64,
    buckets_offset_bytes: u64,
    slots_offset_bytes: u64,
    _pad1: [constants.buffer_header_size_bytes - 88]u8,
};

/// The CLOCK cursors and the never-used high-water marks, on their own cache line.
pub const Clock = extern struct {
    /// Position in the regular pool, modulo slot_count_regular.
    cursor_regular: Atomic(u32),
    /// Position in the reserved pool, modulo slot_count_reserved.
    cursor_reserved: Atomic(u32),
    /// Slots [0, fresh_regular) of the regular pool have been used at least once.
    fresh_regular: Atomic(u32),
    /// Same for the reserved pool, relative to its first slot.
    fresh_reserved: Atomic(u32),
    _pad: [constants.buffer_clock_size_bytes - 16]u8,
};

pub const counter_names = [_][]const u8{
    "hits",            "misses",        "evictions",      "prealloc_hits",
    "waits",           "wakeups",       "takeovers",      "lock_acquisitions",
    "lock_recoveries", "no_slot",       "preallocs",      "removed",
    "touched",         "commits_ready", "commits_failed", "wait_timeouts",
};
pub const counter_count = counter_names.len;
pub const Counter = enum(u32) {
    hits,
    misses,
    evictions,
    prealloc_hits,
    waits,
    wakeups,
    takeovers,
    lock_acquisitions,
    lock_recoveries,
    no_slot,
    preallocs,
    removed,
    touched,
    commits_ready,
    commits_failed,
    wait_timeouts,
};

pub const Counters = extern struct {
    values: [constants.buffer_counters_size_bytes / 8]Atomic(u64),
};

pub const Bucket = extern struct {
    /// 0 when free, else the holder's pid, with `lock_contended_bit` set when someone sleeps.
    lock: Atomic(u32),
    /// First slot of the chain, or `slot_none`.
    head: u32,
};

pub const Slot = extern struct {
    block_id: BlockId,
    shard_index: u32,
    refcount: Atomic(u32),
    state: Atomic(u32),
    /// Futex word: bumped after every state change; never reset, so a stale read always differs.
    version: Atomic(u32),
    accessed: Atomic(u32),
    /// Pid of the process loading the slot while Idle; 0 when nobody owns it.
    owner_pid: Atomic(u32),
    next: u32,
    bucket: Atomic(u32),
    flags: Atomic(u32),
    _pad: [constants.buffer_slot_size_bytes - 52]u8,
};

comptime {
    assert(@sizeOf(Geometry) == 24);
    assert(@sizeOf(Header) == constants.buffer_header_size_bytes);
    assert(@offsetOf(Header, "_pad1") == 88);
    assert(@sizeOf(Clock) == constants.buffer_clock_size_bytes);
    assert(@sizeOf(Counters) == constants.buffer_counters_size_bytes);
    assert(counter_count <= @typeInfo(@FieldType(Counters, "values")).array.len);
    assert(@typeInfo(Counter).@"enum".fields.len == counter_count);
    assert(@sizeOf(Bucket) == constants.buffer_bucket_size_bytes);
    assert(@sizeOf(Slot) == constants.buffer_slot_size_bytes);
    assert(@offsetOf(Slot, "version") % constants.futex_word_size_bytes == 0);
    assert(@offsetOf(Bucket, "lock") % constants.futex_word_size_bytes == 0);
}

const clock_offset_bytes = constants.buffer_header_size_bytes;
const counters_offset_bytes = clock_offset_bytes + constants.buffer_clock_size_bytes;
const buckets_offset_bytes = counters_offset_bytes + constants.buffer_counters_size_bytes;

pub const Status = enum(i32) {
    ok = 0,
    invalid_argument = -1,
    bad_geometry = -100,
    ctrl_too_small = -101,
    bad_magic = -102,
    bad_layout_version = -103,
    geometry_mismatch = -104,
    ctrl_misaligned = -105,
    lock_timeout = -106,
};

pub const GetResult = enum(u8) {
    hit = 0,
    owner = 1,
    waiter = 2,
    no_slot = 3,
    lock_timeout = 4,
};

/// What `wait` reports per slot. `idle` means the timeout expired with the owner alive.
pub const WaitResult = enum(u8) {
    idle = 0,
    ready = 1,
    failed = 2,
    takeover = 3,
    lock_timeout = 4,
};

pub const CommitResult = enum(u8) {
    ok = 0,
    not_owner = 1,
    not_idle = 2,
    lock_timeout = 3,
};

pub const PreallocResult = enum(u8) {
    allocated = 0,
    exists = 1,
    no_slot = 2,
    lock_timeout = 3,
};

/// Bytes a control region needs for `geometry` (which must be valid).
pub fn ctrl_size_bytes(geometry: Geometry) u64 {
    assert(validate_geometry(geometry) == .ok);
    const slots_offset = slots_offset_bytes(geometry);
    const size = slots_offset + @as(u64, geometry.slot_count_total()) * @sizeOf(Slot);
    assert(size > slots_offset);
    return size;
}

fn slots_offset_bytes(geometry: Geometry) u64 {
    const buckets_end = buckets_offset_bytes + @as(u64, geometry.bucket_count) * @sizeOf(Bucket);
    const offset = std.mem.alignForward(u64, buckets_end, constants.buffer_cache_line_bytes);
    assert(offset >= buckets_end);
    return offset;
}

pub fn validate_geometry(geometry: Geometry) Status {
    if (geometry.shard_size_bytes == 0) return .bad_geometry;
    if (geometry.slot_count_regular == 0) return .bad_geometry;
    if (geometry.bucket_count == 0) return .bad_geometry;
    if (geometry.slots_per_segment == 0) return .bad_geometry;
    const total = @as(u64, geometry.slot_count_regular) + geometry.slot_count_reserved;
    if (total > constants.buffer_slot_count_max) return .bad_geometry;
    if (geometry.bucket_count > constants.buffer_bucket_count_max) return .bad_geometry;
    const segments = std.math.divCeil(u64, total, geometry.slots_per_segment) catch unreachable;
    if (segments > constants.buffer_segment_count_max) return .bad_geometry;
    return .ok;
}

/// Test hook (process-local, never in shared memory): `wait` sleeps this long between reading
/// the version+state and blocking, so a test can land a completion inside that window.
pub var debug_wait_pause_ns: u64 = 0;

pub fn current_pid() u32 {
    const pid = linux.getpid();
    assert(pid > 0);
    assert(@as(u32, @intCast(pid)) <= lock_pid_mask);
    return @intCast(pid);
}

/// Whether `pid` names a live process. A zombie (killed, not yet reaped) counts as dead.
pub fn pid_alive(pid: u32) bool {
    assert(pid != 0);
    assert(pid <= lock_pid_mask);
    const rc = linux.kill(@intCast(pid), 0);
    switch (linux.E.init(rc)) {
        .SUCCESS, .PERM => {},
        .SRCH => return false,
        else => return true,
    }
    var path_buffer: [64]u8 = undefined;
    const path = std.fmt.bufPrint(&path_buffer, "/proc/{d}/stat", .{pid}) catch unreachable;
    const file = std.fs.openFileAbsolute(path, .{}) catch return true;
    defer file.close();
    var stat_buffer: [512]u8 = undefined;
    const stat_bytes = file.read(&stat_buffer) catch return true;
    const stat = stat_buffer[0..stat_bytes];
    // The state letter follows the last ')' (the command name may itself contain parentheses).
    const paren = std.mem.lastIndexOfScalar(u8, stat, ')') orelse return true;
    if (paren + 2 >= stat.len) return true;
    const state_letter = stat[paren + 2];
    return state_letter != 'Z' and state_letter != 'X';
}

pub const Buffer = struct {
    header: *Header,
    clock: *Clock,
    counters: *Counters,
    buckets: []Bucket,
    slots: []Slot,
    geometry: Geometry,
    pid: u32,

    /// Lays out a fresh control region at `ctrl_base`. The magic is stored last (release), so a
    /// process that sees it sees the whole layout.
    pub fn init(
        ctrl_base: usize,
        ctrl_bytes: u64,
        geometry: Geometry,
        creator_start_time: u64,
    ) Status {
        if (ctrl_base == 0) return .invalid_argument;
        if (ctrl_base % constants.buffer_cache_line_bytes != 0) return .ctrl_misaligned;
        const geometry_status = validate_geometry(geometry);
        if (geometry_status != .ok) return geometry_status;
        const size_bytes = ctrl_size_bytes(geometry);
        if (ctrl_bytes < size_bytes) return .ctrl_too_small;

        const memory: [*]u8 = @ptrFromInt(ctrl_base);
        @memset(memory[0..@intCast(size_bytes)], 0);
        const header: *Header = @ptrFromInt(ctrl_base);
        const spp = geometry.slots_per_segment;
        header.* = .{
            .magic = Atomic(u64).init(0),
            .layout_version = constants.buffer_layout_version,
            .header_size_bytes = @sizeOf(Header),
            .ctrl_size_bytes = size_bytes,
            .geometry = geometry,
            .segment_count = geometry.segment_count(),
            .slots_per_segment_shift = if (std.math.isPowerOfTwo(spp))
                std.math.log2_int(u32, spp)
            else
                slot_none,
            .creator_pid = current_pid(),
            ._pad0 = 0,
            .creator_start_time = creator_start_time,
            .buckets_offset_bytes = buckets_offset_bytes,
            .slots_offset_bytes = slots_offset_bytes(geometry),
            ._pad1 = @splat(0),
        };
        const buffer = view(ctrl_base, header);
        for (buffer.buckets) |*bucket| {
            bucket.lock = Atomic(u32).init(0);
            bucket.head = slot_none;
        }
        for (buffer.slots, 0..) |*slot, index| {
            slot.bucket = Atomic(u32).init(bucket_free);
            slot.next = slot_none;
            const reserved = index >= geometry.slot_count_regular;
            slot.flags = Atomic(u32).init(if (reserved) slot_flag_reserved else 0);
        }
        // Release: publishes the layout written above to every process that acquires the magic.
        header.magic.store(constants.buffer_magic, .release);
        assert(buffer.slots.len == geometry.slot_count_total());
        return .ok;
    }

    /// Validates the control region at `ctrl_base` against `expected` (the caller's geometry).
    pub fn attach(ctrl_base: usize, ctrl_bytes: u64, expected: ?Geometry) Status {
        if (ctrl_base == 0) return .invalid_argument;
        if (ctrl_base % constants.buffer_cache_line_bytes != 0) return .ctrl_misaligned;
        if (ctrl_bytes < @sizeOf(Header)) return .ctrl_too_small;
        const header: *const Header = @ptrFromInt(ctrl_base);
        // Acquire: pairs with the release store of the magic in `init`.
        if (header.magic.load(.acquire) != constants.buffer_magic) return .bad_magic;
        if (header.layout_version != constants.buffer_layout_version) {
            return .bad_layout_version;
        }
        if (header.header_size_bytes != @sizeOf(Header)) return .bad_layout_version;
        if (validate_geometry(header.geometry) != .ok) return .bad_geometry;
        if (header.ctrl_size_bytes != ctrl_size_bytes(header.geometry)) return .bad_geometry;
        if (ctrl_bytes < header.ctrl_size_bytes) return .ctrl_too_small;
        if (expected) |geometry| {
            if (!std.meta.eql(geometry, header.geometry)) return .geometry_mismatch;
        }
        return .ok;
    }

    /// A process-local view of an attached region. Cheap: a few loads and multiplications.
    pub fn open(ctrl_base: usize) ?Buffer {
        if (ctrl_base == 0 or ctrl_base % constants.buffer_cache_line_bytes != 0) return null;
        const header: *Header = @ptrFromInt(ctrl_base);
        // Acquire: pairs with the release store of the magic in `init`.
        if (header.magic.load(.acquire) != constants.buffer_magic) return null;
        if (header.layout_version != constants.buffer_layout_version) return null;
        return view(ctrl_base, header);
    }

    fn view(ctrl_base: usize, header: *Header) Buffer {
        const geometry = header.geometry;
        assert(validate_geometry(geometry) == .ok);
        const buckets: [*]Bucket = @ptrFromInt(ctrl_base + buckets_offset_bytes);
        const slots: [*]Slot = @ptrFromInt(ctrl_base + slots_offset_bytes(geometry));
        const buffer = Buffer{
            .header = header,
            .clock = @ptrFromInt(ctrl_base + clock_offset_bytes),
            .counters = @ptrFromInt(ctrl_base + counters_offset_bytes),
            .buckets = buckets[0..geometry.bucket_count],
            .slots = slots[0..geometry.slot_count_total()],
            .geometry = geometry,
            .pid = current_pid(),
        };
        assert(@intFromPtr(buffer.slots.ptr) % constants.buffer_cache_line_bytes == 0);
        return buffer;
    }

    // ---------------------------------------------------------------------------------------
    // Counters, hashing, addressing.

    pub fn count(buffer: Buffer, counter: Counter, amount: u64) void {
        assert(@intFromEnum(counter) < counter_count);
        if (amount == 0) return;
        // Monotonic: statistics order nothing else.
        _ = buffer.counters.values[@intFromEnum(counter)].fetchAdd(amount, .monotonic);
    }

    pub fn counter_value(buffer: Buffer, counter: Counter) u64 {
        assert(@intFromEnum(counter) < counter_count);
        return buffer.counters.values[@intFromEnum(counter)].load(.monotonic);
    }

    /// All shards of a block share one bucket, so block-level Touch, lookup and remove walk a
    /// single chain per block.
    pub fn bucket_of(buffer: Buffer, block_id: *const BlockId) u32 {
        const low = std.mem.readInt(u64, block_id[0..8], .little);
        const high = std.mem.readInt(u64, block_id[8..16], .little);
        var mixed = low ^ (high *% 0x9E37_79B9_7F4A_7C15);
        mixed ^= mixed >> 32;
        mixed *%= 0xD6E8_FEB8_6659_FD93;
        mixed ^= mixed >> 32;
        const bucket: u32 = @intCast(mixed % buffer.geometry.bucket_count);
        assert(bucket < buffer.buckets.len);
        return bucket;
    }

    pub const Location = struct { segment: u32, offset_bytes: u64 };

    /// Where slot `slot_index`'s bytes live: shift+mask for a power-of-two slots_per_segment.
    pub fn slot_location(buffer: Buffer, slot_index: u32) Location {
        assert(slot_index < buffer.slots.len);
        const shift = buffer.header.slots_per_segment_shift;
        const per_segment = buffer.geometry.slots_per_segment;
        var segment: u32 = undefined;
        var within: u32 = undefined;
        if (shift != slot_none) {
            assert(per_segment == @as(u32, 1) << @intCast(shift));
            segment = slot_index >> @intCast(shift);
            within = slot_index & (per_segment - 1);
        } else {
            segment = slot_index / per_segment;
            within = slot_index % per_segment;
        }
        assert(segment < buffer.header.segment_count);
        return .{ .segment = segment, .offset_bytes = @as(u64, within) * buffer.geometry.shard_size_bytes };
    }

    // ---------------------------------------------------------------------------------------
    // Bucket locks: the word holds the holder's pid, so a lock left by a killed process is
    // recognised and stolen after a bounded wait.

    fn lock_try(buffer: Buffer, bucket_index: u32) bool {
        assert(bucket_index < buffer.buckets.len);
        const word = &buffer.buckets[bucket_index].lock;
        // Acquire on success: the chain and slot fields written by the previous holder before
        // its release store are visible to us.
        if (word.cmpxchgStrong(0, buffer.pid, .acquire, .monotonic) == null) {
            buffer.count(.lock_acquisitions, 1);
            return true;
        }
        return false;
    }

    fn lock_acquire(buffer: Buffer, bucket_index: u32) error{LockTimeout}!void {
        assert(bucket_index < buffer.buckets.len);
        assert(buffer.pid != 0);
        var spins: u32 = 0;
        while (spins < constants.buffer_lock_spin_count) : (spins += 1) {
            if (buffer.lock_try(bucket_index)) return;
            std.atomic.spinLoopHint();
        }
        const word = &buffer.buckets[bucket_index].lock;
        const deadline_ns = futex.monotonic_ns() + constants.buffer_lock_timeout_ns;
        var rounds: u32 = 0;
        while (rounds < constants.buffer_lock_round_max) : (rounds += 1) {
            const seen = word.load(.monotonic);
            if (seen == 0) {
                // Acquire: as in lock_try. We keep the contended bit since others may sleep.
                if (word.cmpxchgStrong(0, buffer.pid | lock_contended_bit, .acquire, .monotonic) == null) {
                    buffer.count(.lock_acquisitions, 1);
                    return;
                }
                continue;
            }
            const contended = seen | lock_contended_bit;
            if (seen != contended) {
                // Monotonic: only announces a sleeper; the unlock swap reads it.
                if (word.cmpxchgStrong(seen, contended, .monotonic, .monotonic) != null) continue;
            }
            const waited = futex.wait(word, contended, constants.buffer_lock_wait_slice_ns);
            if (waited == .timed_out) {
                const holder = contended & lock_pid_mask;
                if (holder != buffer.pid and !pid_alive(holder)) {
                    // Acquire: take over the dead holder's lock and whatever it left behind.
                    if (word.cmpxchgStrong(contended, buffer.pid | lock_contended_bit, .acquire, .monotonic) == null) {
                        buffer.count(.lock_acquisitions, 1);
                        buffer.count(.lock_recoveries, 1);
                        buffer.repair_bucket(bucket_index);
                        return;
                    }
                }
            }
            if (futex.monotonic_ns() >= deadline_ns) return error.LockTimeout;
        }
        return error.LockTimeout;
    }

    fn lock_release(buffer: Buffer, bucket_index: u32) void {
        assert(bucket_index < buffer.buckets.len);
        const word = &buffer.buckets[bucket_index].lock;
        // Release: publishes our chain and slot writes to the next acquirer.
        const previous = word.swap(0, .release);
        assert(previous & lock_pid_mask == buffer.pid);
        if (previous & lock_contended_bit != 0) futex.wake_all(word);
    }

    /// Restores the chain invariants after stealing the lock of a holder that died mid-update:
    /// slots on the chain that belong elsewhere are unlinked; slots that claim this bucket but
    /// are not on the chain are freed (or detached when still referenced).
    fn repair_bucket(buffer: Buffer, bucket_index: u32) void {
        assert(bucket_index < buffer.buckets.len);
        const bucket = &buffer.buckets[bucket_index];
        var previous: u32 = slot_none;
        var current = bucket.head;
        var steps: u32 = 0;
        while (current != slot_none) : (steps += 1) {
            if (steps > buffer.slots.len or current >= buffer.slots.len) {
                // A corrupt link: cut the chain here; orphans are collected below.
                buffer.set_next(bucket_index, previous, slot_none);
                break;
            }
            const slot = &buffer.slots[current];
            const next = slot.next;
            if (slot.bucket.load(.monotonic) != bucket_index) {
                buffer.set_next(bucket_index, previous, next);
            } else {
                previous = current;
            }
            current = next;
        }
        for (buffer.slots, 0..) |*slot, index| {
            if (slot.bucket.load(.monotonic) != bucket_index) continue;
            if (buffer.chain_contains(bucket_index, @intCast(index))) continue;
            if (slot.refcount.load(.monotonic) == 0) {
                buffer.free_slot(@intCast(index));
            } else {
                // Release: pairs with the acquire load in `release`.
                slot.bucket.store(bucket_detached, .release);
            }
        }
    }

    fn chain_contains(buffer: Buffer, bucket_index: u32, slot_index: u32) bool {
        assert(bucket_index < buffer.buckets.len);
        assert(slot_index < buffer.slots.len);
        var current = buffer.buckets[bucket_index].head;
        var steps: u32 = 0;
        while (current != slot_none and steps <= buffer.slots.len) : (steps += 1) {
            if (current == slot_index) return true;
            current = buffer.slots[current].next;
        }
        return false;
    }

    fn set_next(buffer: Buffer, bucket_index: u32, previous: u32, next: u32) void {
        assert(bucket_index < buffer.buckets.len);
        assert(next == slot_none or next < buffer.slots.len);
        if (previous == slot_none) {
            buffer.buckets[bucket_index].head = next;
        } else {
            buffer.slots[previous].next = next;
        }
    }

    // ---------------------------------------------------------------------------------------
    // Chains. All of these run with the bucket's lock held.

    fn find(buffer: Buffer, bucket_index: u32, block_id: *const BlockId, shard_index: u32) ?u32 {
        assert(bucket_index < buffer.buckets.len);
        var current = buffer.buckets[bucket_index].head;
        var steps: u32 = 0;
        while (current != slot_none) : (steps += 1) {
            assert(steps < buffer.slots.len);
            const slot = &buffer.slots[current];
            assert(slot.bucket.load(.monotonic) == bucket_index);
            if (slot.shard_index == shard_index and std.mem.eql(u8, &slot.block_id, block_id)) {
                return current;
            }
            current = slot.next;
        }
        return null;
    }

    fn link(buffer: Buffer, bucket_index: u32, slot_index: u32) void {
        assert(bucket_index < buffer.buckets.len);
        const slot = &buffer.slots[slot_index];
        assert(slot.bucket.load(.monotonic) == bucket_index);
        const bucket = &buffer.buckets[bucket_index];
        slot.next = bucket.head;
        bucket.head = slot_index;
    }

    fn unlink(buffer: Buffer, bucket_index: u32, slot_index: u32) void {
        assert(bucket_index < buffer.buckets.len);
        assert(buffer.slots[slot_index].bucket.load(.monotonic) == bucket_index);
        var previous: u32 = slot_none;
        var current = buffer.buckets[bucket_index].head;
        var steps: u32 = 0;
        while (current != slot_none) : (steps += 1) {
            assert(steps < buffer.slots.len);
            if (current == slot_index) {
                buffer.set_next(bucket_index, previous, buffer.slots[current].next);
                buffer.slots[current].next = slot_none;
                return;
            }
            previous = current;
            current = buffer.slots[current].next;
        }
        unreachable; // The slot said it was on this chain.
    }

    /// Returns a slot to the free state. The caller holds the slot exclusively (its bucket lock
    /// with refcount 0, or the last reference of a detached slot).
    fn free_slot(buffer: Buffer, slot_index: u32) void {
        const slot = &buffer.slots[slot_index];
        assert(slot.refcount.load(.monotonic) == 0);
        slot.block_id = @splat(0);
        slot.shard_index = 0;
        slot.next = slot_none;
        // Monotonic: published by the release store of `bucket` below.
        slot.state.store(@intFromEnum(State.idle), .monotonic);
        slot.accessed.store(0, .monotonic);
        slot.owner_pid.store(0, .monotonic);
        _ = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
        // Release: an allocator that CASes the bucket from free sees the cleared fields.
        slot.bucket.store(bucket_free, .release);
        assert(slot.next == slot_none);
    }

    // ---------------------------------------------------------------------------------------
    // Allocation: fresh (never used) slots first, then CLOCK second chance.

    const Pool = enum { regular, reserved };

    const Victim = struct {
        slot: u32,
        /// Set when a Ready shard was evicted to make room: the caller may write it below.
        evicted_block_id: BlockId = @splat(0),
        evicted_shard_index: u32 = slot_none,
    };

    fn pool_range(buffer: Buffer, pool: Pool) struct { first: u32, count: u32 } {
        const regular = buffer.geometry.slot_count_regular;
        assert(regular > 0);
        return switch (pool) {
            .regular => .{ .first = 0, .count = regular },
            .reserved => .{ .first = regular, .count = buffer.geometry.slot_count_reserved },
        };
    }

    fn take_fresh(buffer: Buffer, pool: Pool, bucket_index: u32) ?u32 {
        const range = buffer.pool_range(pool);
        const high_water = switch (pool) {
            .regular => &buffer.clock.fresh_regular,
            .reserved => &buffer.clock.fresh_reserved,
        };
        var attempts: u32 = 0;
        while (attempts < range.count + 1) : (attempts += 1) {
            const used = high_water.load(.monotonic);
            if (used >= range.count) return null;
            // Monotonic: the slot itself is claimed by the acquire CAS on its bucket word.
            if (high_water.cmpxchgWeak(used, used + 1, .monotonic, .monotonic) != null) continue;
            const slot_index = range.first + used;
            if (buffer.claim_free(slot_index, bucket_index)) return slot_index;
        }
        return null;
    }

    fn claim_free(buffer: Buffer, slot_index: u32, bucket_index: u32) bool {
        assert(bucket_index < buffer.buckets.len);
        const slot = &buffer.slots[slot_index];
        // Acquire: pairs with the release store in `free_slot`.
        if (slot.bucket.cmpxchgStrong(bucket_free, bucket_index, .acquire, .monotonic) != null) {
            return false;
        }
        assert(slot.refcount.load(.monotonic) == 0);
        return true;
    }

    /// CLOCK over one pool: one lap of second chances (clearing bits), then one lap on the raw
    /// cursor taking the first slot not in use. Null when every slot is in use (or locked).
    fn clock_victim(buffer: Buffer, pool: Pool, bucket_index: u32, idle_only: bool) ?Victim {
        const range = buffer.pool_range(pool);
        if (range.count == 0) return null;
        const cursor = switch (pool) {
            .regular => &buffer.clock.cursor_regular,
            .reserved => &buffer.clock.cursor_reserved,
        };
        var step: u32 = 0;
        while (step < 2 * range.count) : (step += 1) {
            const second_chance = step < range.count;
            const position = buffer.advance_cursor(cursor, range.count);
            const slot_index = range.first + position;
            if (buffer.try_evict(slot_index, bucket_index, second_chance, idle_only)) |victim| {
                return victim;
            }
        }
        return null;
    }

    /// Returns the cursor's position and moves it one step, modulo `count`.
    fn advance_cursor(buffer: Buffer, cursor: *Atomic(u32), slot_count: u32) u32 {
        _ = buffer;
        assert(slot_count > 0);
        var attempts: u32 = 0;
        while (attempts < constants.buffer_cas_attempts_max) : (attempts += 1) {
            const position = cursor.load(.monotonic) % slot_count;
            // Monotonic: the cursor is a hint; slot ownership is decided under bucket locks.
            if (cursor.cmpxchgWeak(position, (position + 1) % slot_count, .monotonic, .monotonic) == null) {
                return position;
            }
        }
        // Heavy contention: any position is a valid place to look.
        return cursor.fetchAdd(1, .monotonic) % slot_count;
    }

    fn try_evict(
        buffer: Buffer,
        slot_index: u32,
        bucket_index: u32,
        second_chance: bool,
        idle_only: bool,
    ) ?Victim {
        assert(slot_index < buffer.slots.len);
        const slot = &buffer.slots[slot_index];
        if (second_chance) {
            // Monotonic: the accessed bit is a hint; clearing it never breaks an invariant.
            if (slot.accessed.swap(0, .monotonic) != 0) return null;
        }
        if (slot.refcount.load(.monotonic) != 0) return null;
        const owner_bucket = slot.bucket.load(.monotonic);
        if (owner_bucket == bucket_free) {
            if (buffer.claim_free(slot_index, bucket_index)) return .{ .slot = slot_index };
            return null;
        }
        if (owner_bucket == bucket_detached) return null;
        assert(owner_bucket < buffer.buckets.len);
        const own_lock = owner_bucket == bucket_index;
        if (!own_lock and !buffer.lock_try(owner_bucket)) return null;
        defer if (!own_lock) buffer.lock_release(owner_bucket);
        // Re-check under the owning bucket's lock: refcounts only grow under it.
        if (slot.bucket.load(.monotonic) != owner_bucket) return null;
        if (slot.refcount.load(.monotonic) != 0) return null;
        const ready = slot.state.load(.monotonic) == @intFromEnum(State.ready);
        if (idle_only and ready) return null;
        var victim = Victim{ .slot = slot_index };
        if (ready) {
            victim.evicted_block_id = slot.block_id;
            victim.evicted_shard_index = slot.shard_index;
            buffer.count(.evictions, 1);
        }
        buffer.unlink(owner_bucket, slot_index);
        // Monotonic: both bucket locks are held; their release stores publish this.
        slot.bucket.store(bucket_index, .monotonic);
        return victim;
    }

    /// Initialises a claimed slot for a key and links it. Refcount is set after linking so a
    /// crash in between leaves an idle, takeover-able slot rather than a leaked reference.
    fn install(
        buffer: Buffer,
        bucket_index: u32,
        slot_index: u32,
        block_id: *const BlockId,
        shard_index: u32,
        owner: bool,
    ) void {
        const slot = &buffer.slots[slot_index];
        assert(slot.bucket.load(.monotonic) == bucket_index);
        assert(slot.refcount.load(.monotonic) == 0);
        slot.block_id = block_id.*;
        slot.shard_index = shard_index;
        // Monotonic: every reader of these fields holds this bucket's lock or a reference
        // taken under it; the lock release publishes them.
        slot.state.store(@intFromEnum(State.idle), .monotonic);
        slot.owner_pid.store(if (owner) buffer.pid else 0, .monotonic);
        slot.accessed.store(if (owner) 1 else 0, .monotonic);
        if (owner) {
            _ = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
        } else {
            _ = slot.flags.fetchOr(slot_flag_preallocated, .monotonic);
        }
        buffer.link(bucket_index, slot_index);
        if (owner) slot.refcount.store(1, .monotonic);
    }

    // ---------------------------------------------------------------------------------------
    // Operations. Each takes a batch; per-key outcomes go to caller arrays.

    pub const GetOutput = struct {
        results: []GetResult,
        slots: []u32,
        evicted_block_ids: ?[]BlockId = null,
        evicted_shard_indices: ?[]u32 = null,
    };

    pub fn get(
        buffer: Buffer,
        block_ids: []const BlockId,
        shard_indices: []const u32,
        out: GetOutput,
    ) void {
        assert(block_ids.len == shard_indices.len);
        assert(out.results.len == block_ids.len and out.slots.len == block_ids.len);
        for (block_ids, shard_indices, 0..) |*block_id, shard_index, index| {
            out.slots[index] = slot_none;
            if (out.evicted_shard_indices) |evicted| evicted[index] = slot_none;
            const bucket_index = buffer.bucket_of(block_id);
            buffer.lock_acquire(bucket_index) catch {
                out.results[index] = .lock_timeout;
                continue;
            };
            defer buffer.lock_release(bucket_index);
            if (buffer.find(bucket_index, block_id, shard_index)) |slot_index| {
                out.slots[index] = slot_index;
                out.results[index] = buffer.get_resident(slot_index);
                continue;
            }
            buffer.count(.misses, 1);
            const victim = buffer.allocate_for_get(bucket_index) orelse {
                buffer.count(.no_slot, 1);
                out.results[index] = .no_slot;
                continue;
            };
            buffer.install(bucket_index, victim.slot, block_id, shard_index, true);
            out.slots[index] = victim.slot;
            out.results[index] = .owner;
            if (out.evicted_block_ids) |evicted| evicted[index] = victim.evicted_block_id;
            if (out.evicted_shard_indices) |evicted| evicted[index] = victim.evicted_shard_index;
        }
    }

    fn get_resident(buffer: Buffer, slot_index: u32) GetResult {
        const slot = &buffer.slots[slot_index];
        const refcount = slot.refcount.load(.monotonic);
        const state: State = @enumFromInt(slot.state.load(.monotonic));
        assert(state != .failed); // Failed slots are detached by `commit`.
        // Monotonic refcount/bit updates: the bucket lock orders them.
        if (state == .ready) {
            slot.refcount.store(refcount + 1, .monotonic);
            slot.accessed.store(1, .monotonic);
            buffer.count(.hits, 1);
            return .hit;
        }
        buffer.count(.misses, 1);
        if (refcount == 0) {
            // Hit-or-takeover fast path: an idle slot hung by Prealloc (or left by an owner
            // that gave up): become its owner without searching for a victim.
            const flags = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
            if (flags & slot_flag_preallocated != 0) buffer.count(.prealloc_hits, 1);
            slot.owner_pid.store(buffer.pid, .monotonic);
            slot.accessed.store(1, .monotonic);
            slot.refcount.store(1, .monotonic);
            return .owner;
        }
        slot.refcount.store(refcount + 1, .monotonic);
        return .waiter;
    }

    fn allocate_for_get(buffer: Buffer, bucket_index: u32) ?Victim {
        if (buffer.take_fresh(.regular, bucket_index)) |slot_index| return .{ .slot = slot_index };
        if (buffer.clock_victim(.regular, bucket_index, false)) |victim| return victim;
        if (buffer.take_fresh(.reserved, bucket_index)) |slot_index| return .{ .slot = slot_index };
        return buffer.clock_victim(.reserved, bucket_index, false);
    }

    /// Owner publishes the final state: state first, then the version (release), then wake.
    pub fn commit(buffer: Buffer, slot_indices: []const u32, states: []const u8, out: []CommitResult) void {
        assert(slot_indices.len == states.len and out.len == states.len);
        for (slot_indices, states, out) |slot_index, state_code, *result| {
            assert(slot_index < buffer.slots.len);
            assert(state_code == @intFromEnum(State.ready) or state_code == @intFromEnum(State.failed));
            const state: State = @enumFromInt(state_code);
            const slot = &buffer.slots[slot_index];
            if (slot.owner_pid.load(.monotonic) != buffer.pid) {
                result.* = .not_owner;
                continue;
            }
            if (slot.state.load(.monotonic) != @intFromEnum(State.idle)) {
                result.* = .not_idle;
                continue;
            }
            if (state == .failed) {
                buffer.detach_failed(slot_index) catch {
                    result.* = .lock_timeout;
                    continue;
                };
                buffer.count(.commits_failed, 1);
            } else {
                // Release: the shard bytes written before are visible to whoever acquires it.
                slot.state.store(@intFromEnum(State.ready), .release);
                buffer.count(.commits_ready, 1);
            }
            // `bump` increments with release ordering and wakes every waiter (futex.zig).
            _ = futex.bump(&slot.version);
            result.* = .ok;
        }
    }

    /// Failures are not remembered: the slot leaves its chain at once (a later Get retries the
    /// key in a fresh slot) and is freed by its last release.
    fn detach_failed(buffer: Buffer, slot_index: u32) error{LockTimeout}!void {
        const slot = &buffer.slots[slot_index];
        assert(slot.refcount.load(.monotonic) > 0);
        const bucket_index = slot.bucket.load(.acquire);
        if (bucket_index == bucket_detached) {
            slot.state.store(@intFromEnum(State.failed), .release);
            return;
        }
        assert(bucket_index < buffer.buckets.len);
        try buffer.lock_acquire(bucket_index);
        defer buffer.lock_release(bucket_index);
        // Release: pairs with the acquire load of the state in `wait`.
        slot.state.store(@intFromEnum(State.failed), .release);
        if (slot.bucket.load(.monotonic) == bucket_index) {
            buffer.unlink(bucket_index, slot_index);
            slot.bucket.store(bucket_detached, .release);
        }
    }

    /// Blocks until each slot leaves Idle, all within one deadline. A dead owner's slot is taken
    /// over (reported as `takeover`: the caller is now the owner and must load and commit).
    pub fn wait(buffer: Buffer, slot_indices: []const u32, timeout_ns: u64, out: []WaitResult) void {
        assert(slot_indices.len == out.len);
        const deadline_ns = futex.monotonic_ns() +| timeout_ns;
        for (slot_indices, out) |slot_index, *result| {
            assert(slot_index < buffer.slots.len);
            result.* = buffer.wait_one(slot_index, deadline_ns);
        }
    }

    fn wait_one(buffer: Buffer, slot_index: u32, deadline_ns: u64) WaitResult {
        const slot = &buffer.slots[slot_index];
        assert(slot.refcount.load(.monotonic) > 0); // Waiters hold a reference.
        var blocked = false;
        var rounds: u32 = 0;
        while (rounds < constants.buffer_wait_round_max) : (rounds += 1) {
            // Acquire (version, then state): pairs with commit's release store and increment.
            // Reading the version first is what makes a completion between here and the futex
            // call visible: it changes the version, so FUTEX_WAIT returns at once.
            const version = slot.version.load(.acquire);
            const state: State = @enumFromInt(slot.state.load(.acquire));
            if (state != .idle) return if (state == .ready) .ready else .failed;
            if (debug_wait_pause_ns > 0) std.Thread.sleep(debug_wait_pause_ns);
            const owner = slot.owner_pid.load(.monotonic);
            // An owner in this very process (another thread) is alive: keep waiting.
            if (owner != buffer.pid and (owner == 0 or !pid_alive(owner))) {
                switch (buffer.take_over(slot_index, owner)) {
                    .taken => return .takeover,
                    .lost => continue,
                    .lock_timeout => return .lock_timeout,
                }
            }
            const now_ns = futex.monotonic_ns();
            if (now_ns >= deadline_ns) {
                buffer.count(.wait_timeouts, 1);
                return .idle;
            }
            if (!blocked) buffer.count(.waits, 1);
            blocked = true;
            const slice_ns = @min(deadline_ns - now_ns, constants.futex_wait_slice_ns);
            if (futex.wait(&slot.version, version, slice_ns) == .changed) buffer.count(.wakeups, 1);
        }
        return .idle;
    }

    const TakeOver = enum { taken, lost, lock_timeout };

    fn take_over(buffer: Buffer, slot_index: u32, dead_owner: u32) TakeOver {
        const slot = &buffer.slots[slot_index];
        assert(dead_owner != buffer.pid);
        const bucket_index = slot.bucket.load(.acquire);
        const locked = bucket_index != bucket_detached;
        if (locked) {
            assert(bucket_index < buffer.buckets.len);
            buffer.lock_acquire(bucket_index) catch return .lock_timeout;
        }
        defer if (locked) buffer.lock_release(bucket_index);
        if (locked and slot.bucket.load(.monotonic) != bucket_index) return .lost;
        if (slot.state.load(.monotonic) != @intFromEnum(State.idle)) return .lost;
        // CAS: another waiter may take over the same slot at the same time (detached slots are
        // not under a lock). Monotonic: the slot's data is rewritten by the new owner anyway.
        if (slot.owner_pid.cmpxchgStrong(dead_owner, buffer.pid, .monotonic, .monotonic) != null) {
            return .lost;
        }
        // The dead owner held one reference (taken by its Get); drop it on its behalf.
        if (dead_owner != 0) {
            const previous = slot.refcount.fetchSub(1, .monotonic);
            assert(previous >= 2); // The dead owner's reference and ours.
        }
        slot.accessed.store(1, .monotonic);
        buffer.count(.takeovers, 1);
        return .taken;
    }

    /// Drops one reference per slot. Returns how many were released (all unless a lock timed out).
    pub fn release(buffer: Buffer, slot_indices: []const u32) u32 {
        var released: u32 = 0;
        for (slot_indices) |slot_index| {
            assert(slot_index < buffer.slots.len);
            if (buffer.release_one(slot_index)) released += 1;
        }
        assert(released <= slot_indices.len);
        return released;
    }

    fn release_one(buffer: Buffer, slot_index: u32) bool {
        const slot = &buffer.slots[slot_index];
        var attempts: u32 = 0;
        while (attempts < 2) : (attempts += 1) {
            // Acquire: pairs with the release store that detached the slot.
            const bucket_index = slot.bucket.load(.acquire);
            if (bucket_index == bucket_detached) {
                // AcqRel: the last releaser must see every other holder's accesses.
                const previous = slot.refcount.fetchSub(1, .acq_rel);
                assert(previous > 0);
                if (previous == 1) buffer.free_slot(slot_index);
                return true;
            }
            assert(bucket_index < buffer.buckets.len);
            buffer.lock_acquire(bucket_index) catch return false;
            defer buffer.lock_release(bucket_index);
            // Only a detach can move a referenced slot; retry on the detached path.
            if (slot.bucket.load(.monotonic) != bucket_index) continue;
            const refcount = slot.refcount.load(.monotonic);
            assert(refcount > 0);
            const idle = slot.state.load(.monotonic) == @intFromEnum(State.idle);
            if (idle and slot.owner_pid.load(.monotonic) == buffer.pid) {
                // The owner gives up without committing: waiters may take over.
                slot.owner_pid.store(0, .monotonic);
            }
            slot.refcount.store(refcount - 1, .monotonic);
            return true;
        }
        unreachable; // A slot is detached at most once while referenced.
    }

    /// Hangs idle, unreferenced slots for keys not yet resident (seed §3.4): from never-used
    /// regular slots, else from the reserved pool (fresh, or an unused idle prewarm recycled by
    /// CLOCK); never evicts Ready data, so speculation never costs a resident shard.
    pub fn prealloc(buffer: Buffer, block_ids: []const BlockId, shard_indices: []const u32, out: []PreallocResult) void {
        assert(block_ids.len == shard_indices.len and out.len == block_ids.len);
        for (block_ids, shard_indices, out) |*block_id, shard_index, *result| {
            const bucket_index = buffer.bucket_of(block_id);
            buffer.lock_acquire(bucket_index) catch {
                result.* = .lock_timeout;
                continue;
            };
            defer buffer.lock_release(bucket_index);
            if (buffer.find(bucket_index, block_id, shard_index) != null) {
                result.* = .exists;
                continue;
            }
            const slot_index = buffer.take_fresh(.regular, bucket_index) orelse
                buffer.take_fresh(.reserved, bucket_index) orelse
                if (buffer.clock_victim(.reserved, bucket_index, true)) |victim| victim.slot else null;
            if (slot_index) |index| {
                buffer.install(bucket_index, index, block_id, shard_index, false);
                buffer.count(.preallocs, 1);
                result.* = .allocated;
            } else {
                result.* = .no_slot;
            }
        }
    }

    /// Sets the accessed bit of every resident shard of each block. Returns shards touched.
    pub fn touch(buffer: Buffer, block_ids: []const BlockId) error{LockTimeout}!u64 {
        var touched: u64 = 0;
        for (block_ids) |*block_id| {
            const bucket_index = buffer.bucket_of(block_id);
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            var current = buffer.buckets[bucket_index].head;
            var steps: u32 = 0;
            while (current != slot_none) : (steps += 1) {
                assert(steps < buffer.slots.len);
                const slot = &buffer.slots[current];
                if (std.mem.eql(u8, &slot.block_id, block_id) and
                    slot.state.load(.monotonic) == @intFromEnum(State.ready))
                {
                    // Monotonic: a hint for CLOCK only.
                    slot.accessed.store(1, .monotonic);
                    touched += 1;
                }
                current = slot.next;
            }
        }
        buffer.count(.touched, touched);
        assert(touched <= @as(u64, block_ids.len) * buffer.slots.len);
        return touched;
    }

    /// Exists-and-Ready per key; needs no data plane (the scheduler role uses it).
    pub fn lookup(buffer: Buffer, block_ids: []const BlockId, shard_indices: []const u32, out: []u8) error{LockTimeout}!void {
        assert(block_ids.len == shard_indices.len and out.len == block_ids.len);
        for (block_ids, shard_indices, out) |*block_id, shard_index, *present| {
            const bucket_index = buffer.bucket_of(block_id);
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            present.* = 0;
            if (buffer.find(bucket_index, block_id, shard_index)) |slot_index| {
                const state = buffer.slots[slot_index].state.load(.monotonic);
                present.* = @intFromBool(state == @intFromEnum(State.ready));
            }
        }
    }

    /// A block is present when every shard 0..shards_per_block-1 is Ready.
    pub fn lookup_blocks(buffer: Buffer, block_ids: []const BlockId, shards_per_block: u32, out: []u8) error{LockTimeout}!void {
        assert(block_ids.len == out.len);
        assert(shards_per_block > 0);
        for (block_ids, out) |*block_id, *present| {
            const bucket_index = buffer.bucket_of(block_id);
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            // Keys are unique on a chain, so counting Ready shards in range is exact.
            var ready: u64 = 0;
            var current = buffer.buckets[bucket_index].head;
            var steps: u32 = 0;
            while (current != slot_none) : (steps += 1) {
                assert(steps < buffer.slots.len);
                const slot = &buffer.slots[current];
                if (slot.shard_index < shards_per_block and
                    std.mem.eql(u8, &slot.block_id, block_id) and
                    slot.state.load(.monotonic) == @intFromEnum(State.ready))
                {
                    ready += 1;
                }
                current = slot.next;
            }
            present.* = @intFromBool(ready == shards_per_block);
        }
    }

    /// Removes keys with one lock acquisition per distinct bucket per chunk of
    /// `buffer_remove_chunk_keys` keys (seed 003). Referenced slots are kept unless `force`
    /// (then they are detached and freed by their last release). Returns Ready shards removed.
    pub fn remove(buffer: Buffer, block_ids: []const BlockId, shard_indices: ?[]const u32, force: bool) error{LockTimeout}!u64 {
        if (shard_indices) |shards| assert(shards.len == block_ids.len);
        var removed: u64 = 0;
        var chunk_start: usize = 0;
        var chunks: usize = 0;
        while (chunk_start < block_ids.len) : (chunks += 1) {
            assert(chunks <= block_ids.len / constants.buffer_remove_chunk_keys + 1);
            const chunk_end = @min(block_ids.len, chunk_start + constants.buffer_remove_chunk_keys);
            removed += try buffer.remove_chunk(block_ids, shard_indices, chunk_start, chunk_end, force);
            chunk_start = chunk_end;
        }
        buffer.count(.removed, removed);
        return removed;
    }

    fn remove_chunk(
        buffer: Buffer,
        block_ids: []const BlockId,
        shard_indices: ?[]const u32,
        chunk_start: usize,
        chunk_end: usize,
        force: bool,
    ) error{LockTimeout}!u64 {
        assert(chunk_end - chunk_start <= constants.buffer_remove_chunk_keys);
        assert(chunk_start < chunk_end);
        const Entry = struct { bucket: u32, index: u32 };
        var entries_buffer: [constants.buffer_remove_chunk_keys]Entry = undefined;
        const entries = entries_buffer[0 .. chunk_end - chunk_start];
        for (entries, chunk_start..) |*entry, index| {
            entry.* = .{ .bucket = buffer.bucket_of(&block_ids[index]), .index = @intCast(index) };
        }
        std.mem.sort(Entry, entries, {}, struct {
            fn less(_: void, a: Entry, b: Entry) bool {
                return a.bucket < b.bucket or (a.bucket == b.bucket and a.index < b.index);
            }
        }.less);
        var removed: u64 = 0;
        var group_start: usize = 0;
        while (group_start < entries.len) {
            const bucket_index = entries[group_start].bucket;
            var group_end = group_start;
            while (group_end < entries.len and entries[group_end].bucket == bucket_index) {
                group_end += 1;
            }
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            for (entries[group_start..group_end]) |entry| {
                const block_id = &block_ids[entry.index];
                if (shard_indices) |shards| {
                    if (buffer.find(bucket_index, block_id, shards[entry.index])) |slot_index| {
                        removed += buffer.remove_slot(bucket_index, slot_index, force);
                    }
                } else {
                    removed += buffer.remove_block_in_bucket(bucket_index, block_id, force);
                }
            }
            group_start = group_end;
        }
        return removed;
    }

    fn remove_block_in_bucket(buffer: Buffer, bucket_index: u32, block_id: *const BlockId, force: bool) u64 {
        var removed: u64 = 0;
        var current = buffer.buckets[bucket_index].head;
        var steps: u32 = 0;
        while (current != slot_none) : (steps += 1) {
            assert(steps < buffer.slots.len);
            const next = buffer.slots[current].next;
            if (std.mem.eql(u8, &buffer.slots[current].block_id, block_id)) {
                removed += buffer.remove_slot(bucket_index, current, force);
            }
            current = next;
        }
        assert(removed <= steps);
        return removed;
    }

    /// Returns 1 when a Ready shard left the buffer, 0 otherwise (kept, or idle/no data).
    fn remove_slot(buffer: Buffer, bucket_index: u32, slot_index: u32, force: bool) u64 {
        const slot = &buffer.slots[slot_index];
        assert(slot.bucket.load(.monotonic) == bucket_index);
        const was_ready = slot.state.load(.monotonic) == @intFromEnum(State.ready);
        if (slot.refcount.load(.monotonic) == 0) {
            buffer.unlink(bucket_index, slot_index);
            buffer.free_slot(slot_index);
        } else if (force) {
            buffer.unlink(bucket_index, slot_index);
            // Release: pairs with the acquire load in `release_one`.
            slot.bucket.store(bucket_detached, .release);
        } else {
            return 0;
        }
        return @intFromBool(was_ready);
    }

    // ---------------------------------------------------------------------------------------
    // Introspection for tests and tools.

    pub fn find_locked(buffer: Buffer, block_id: *const BlockId, shard_index: u32) error{LockTimeout}!?u32 {
        const bucket_index = buffer.bucket_of(block_id);
        try buffer.lock_acquire(bucket_index);
        defer buffer.lock_release(bucket_index);
        return buffer.find(bucket_index, block_id, shard_index);
    }

    pub fn cursor_position(buffer: Buffer, pool: Pool) u32 {
        const range = buffer.pool_range(pool);
        if (range.count == 0) return 0;
        const word = switch (pool) {
            .regular => &buffer.clock.cursor_regular,
            .reserved => &buffer.clock.cursor_reserved,
        };
        return word.load(.monotonic) % range.count;
    }

    /// Test hook: takes a bucket lock and keeps it (to kill the holder and test recovery).
    pub fn debug_hold_lock(buffer: Buffer, bucket_index: u32) error{LockTimeout}!void {
        assert(bucket_index < buffer.buckets.len);
        try buffer.lock_acquire(bucket_index);
    }

    pub fn debug_drop_lock(buffer: Buffer, bucket_index: u32) void {
        assert(bucket_index < buffer.buckets.len);
        buffer.lock_release(bucket_index);
    }
};
