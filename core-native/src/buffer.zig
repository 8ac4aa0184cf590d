//! The CacheBuffer control plane (seed §3.2–3.4): everything every rank of a node shares to
//! decide which slot holds which shard, who loads it, and who waits for it.
//!
//! The control region is caller-provided memory (a shared mapping) laid out once by `init` and
//! validated by `attach`. It holds no pointers, only indices and offsets, so every process may
//! map it at a different address:
//!
//!   [Header][Clock][Counters][Holders][Namespaces][NamespaceNames][Controls][RemovalLog]
//!   [Bucket × bucket_count][Slot × (regular + reserved)]
//!
//! Locking: each hash bucket has a cross-process lock word holding the holder's pid. A slot's
//! key, chain link, holders, owner and state transitions are changed only under the lock of the
//! bucket it is linked into. A free slot (`bucket == bucket_free`) is claimed with a CAS, a
//! slot detached from its chain (failed, or force-removed while in use) is only released.
//!
//! References (who is using a slot) are recorded per *holder*: every process registers once in
//! the holder table (pid + start time, so a reused pid is never mistaken for the dead process)
//! and gets an index 0..63. A slot's `holders` word is a bitmap of the holders that reference
//! it; the refcount is its popcount. Rule: a holder holds at most one reference per slot (a
//! repeated Get answers `held`; the Python side serialises a process's calls per tier and
//! dedups keys). Why a bitmap and not a count per (slot, holder): one atomic word is the whole
//! truth, so a process killed at any instruction leaves either its bit or not, never a count
//! that nobody can attribute; recovering a dead process is "clear its bit" under the bucket lock
//! (or one atomic AND on a detached slot), and the slot stays 64 bytes.
//! Dead holders are found by `scan_holders` (pid + start time) and marked in `dead_mask`; Get,
//! eviction, remove and wait drop the references of marked holders they meet, and
//! `reclaim_dead` sweeps every slot, then frees the entries for reuse.
//! Eviction holds the new key's bucket lock and only *tries* the victim's bucket lock, so two
//! bucket locks are never waited for at once and there is no lock-order deadlock.
//!
//! The removal log (`removal_log.zig`) has its own section after the namespace table: purges
//! and forced removes, which writers to lower tiers read (`ucm/finality.py`).
//!
//! Namespaces (quotas): a key's first 8 bytes are its namespace's tag (`ucm/namespaces.py`).
//! A fixed table maps registered tags to an index (entry 0: the default namespace, and every
//! key whose tag is not registered) holding the namespace's guarantee and cap in slots and
//! its occupancy: the number of slots linked into a chain whose `Slot.namespace` is index + 1.
//! Both change together, under the slot's bucket lock (install, eviction, detach, remove,
//! free). A kill between the two is repaired by `reclaim_dead`, which recounts every
//! namespace from the chains while holding every bucket lock. CLOCK skips the slots of a
//! namespace at or below its guarantee when another namespace inserts (the occupancy is
//! decremented by a CAS that refuses to cross the guarantee), and a namespace at its cap
//! evicts its own slots only.
//!
//! Control records (reset epochs): a fixed table of named monotonic maxima, outside every
//! slot, chain, quota and eviction. An entry is claimed free -> registering by CAS, its name
//! and first value written, then published live (release); a value only grows (`fetchMax`).
//! Two processes registering one new name at once may take two entries: a read answers the
//! maximum over every live entry of the name, so the two stay one record. An entry left
//! `registering` by a process killed in between is never published (lost to the table; the
//! raise it belonged to never returned).
//!
//! Namespace identities: the only authority on which tag is whose. `NamespaceNames` maps every
//! tag a process uses with the buffer to its name (open addressing, entries never freed); a
//! process enters its namespace before its first key of it can land, so a key whose tag no
//! entry holds is the default namespace's, and any process (a fresh `ucm purge`) resolves
//! every key. One registration lock (a pid word, stolen from a dead holder like a bucket lock)
//! serialises every change to both tables: one entry per tag, and the guarantee sum is checked
//! and committed at once. Readers take no lock: an entry's name is published by a release store
//! of its length.
//!
//! Data slots are addressed as segment_base[segment] + offset; `slot_location` computes the
//! pair with shift+mask when slots_per_segment is a power of two, else with div/mod.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const futex = @import("futex.zig");
const seg_sys = @import("seg_sys.zig");
const removal_log = @import("removal_log.zig");

const assert = std.debug.assert;
const Atomic = std.atomic.Value;

pub const slot_none: u32 = std.math.maxInt(u32);
/// `Slot.bucket` of a slot on no chain that nobody holds: claimable by CAS.
pub const bucket_free: u32 = std.math.maxInt(u32);
/// `Slot.bucket` of a slot unlinked while still referenced; freed by its last release.
pub const bucket_detached: u32 = std.math.maxInt(u32) - 1;

pub const block_id_size_bytes = 16;
pub const BlockId = [block_id_size_bytes]u8;

/// `failed` and `missing` are both final and detach the slot; `missing` says the owner found
/// the key in no tier, so waiters in other processes can report a miss rather than an error.
pub const State = enum(u32) { idle = 0, ready = 1, failed = 2, missing = 3 };

pub const slot_flag_reserved: u32 = 1 << 0;
pub const slot_flag_preallocated: u32 = 1 << 1;
/// Write-back debt: the slot's Ready shard is not yet in the `write: back` tiers below. Set by a
/// dump's commit, cleared once a flusher wrote it down (or the key is removed). A dirty slot is
/// never an eviction victim, so the debt is paid by flushing, never by dropping the only copy.
pub const slot_flag_dirty: u32 = 1 << 2;

/// OR'ed into a commit's state code: publish the slot Ready *and* dirty (a dump into a buffer
/// that has `write: back` tiers below it).
/// Admission (`admit`): bit `slot_flag_admitted_shift + t` set once the shard was admitted to
/// the lower tier of admission index t (`admission_tiers_max` of them), so exactly one process
/// node-wide writes it there; bit `slot_flag_matured_shift + t` once it survived that tier's
/// minimum residency. Cleared with the other flags when the slot is installed or freed.
pub const slot_flag_admitted_shift: u5 = 8;
pub const slot_flag_matured_shift: u5 = 16;
pub const admission_tiers_max: u32 = 8;
pub const reuses_max: u16 = std.math.maxInt(u16);
pub const commit_dirty_bit: u8 = 0x80;

const lock_contended_bit: u32 = 1 << 31;
const lock_pid_mask: u32 = lock_contended_bit - 1;

pub const holder_none: u32 = std.math.maxInt(u32);

/// Holder entry states (high 32 bits of `HolderEntry.tag`; the low 32 bits are the pid).
pub const HolderState = enum(u32) { free = 0, registering = 1, live = 2, dead = 3 };

pub fn holder_tag(state: HolderState, pid: u32) u64 {
    return (@as(u64, @intFromEnum(state)) << 32) | pid;
}

pub fn holder_bit(holder: u32) u64 {
    assert(holder < constants.buffer_holders_max);
    return @as(u64, 1) << @intCast(holder);
}

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
    "hits",            "misses",         "evictions",      "prealloc_hits",
    "waits",           "wakeups",        "takeovers",      "lock_acquisitions",
    "lock_recoveries", "no_slot",        "preallocs",      "removed",
    "touched",         "commits_ready",  "commits_failed", "wait_timeouts",
    "dead_holders",    "refs_reclaimed", "holders_freed",  "remove_lock_acquisitions",
    "dirty_slots",     "flushed",        "wait_slices",    "write_through_skipped",
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
    dead_holders,
    refs_reclaimed,
    holders_freed,
    /// Bucket locks taken by batched removes (part of lock_acquisitions): seed 003's figure.
    remove_lock_acquisitions,
    /// A gauge, not a count: slots holding write-back debt right now (`slot_flag_dirty`).
    dirty_slots,
    /// Dirty slots written down and cleaned by flushers.
    flushed,
    /// Futex slices a waiter slept out without a change (then checked the owner's liveness):
    /// a wake-up that the commit delivered, or a change seen before blocking, counts none.
    wait_slices,
    /// Shard writes (one per shard and `write: through` tier) that the ranks' dumps skipped
    /// because their write-through backlog was full: counted by the ranks (Python), node-wide
    /// here so that `ucm stats` sees every rank's. The control plane never counts it itself.
    write_through_skipped,
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

/// Slot counts by where the slots are (`Buffer.occupancy`); the C ABI's `ucm_buffer_occupancy`.
pub const Occupancy = extern struct {
    resident: u64 = 0,
    filling: u64 = 0,
    preallocated: u64 = 0,
    in_use: u64 = 0,
    waiters: u64 = 0,
    free: u64 = 0,
    detached: u64 = 0,
    resident_reserved: u64 = 0,
};

comptime {
    assert(@sizeOf(Occupancy) == 8 * 8);
}

pub const Slot = extern struct {
    block_id: BlockId,
    shard_index: u32,
    state: Atomic(u32),
    /// Futex word: bumped after every state change; never reset, so a stale read always differs.
    version: Atomic(u32),
    accessed: Atomic(u32),
    /// Holder index + 1 of the process loading the slot while Idle; 0 when nobody owns it.
    owner: Atomic(u32),
    next: u32,
    bucket: Atomic(u32),
    flags: Atomic(u32),
    /// Bit h set: holder h holds a reference (at most one). The refcount is its popcount.
    holders: Atomic(u64),
    /// Holder index + 1 of the process writing this dirty slot down (`take_dirty`), else 0.
    flusher: Atomic(u32),
    /// Namespace index + 1 this slot counts for (while linked into a chain), else 0. Written
    /// under the bucket lock with the namespace's occupancy; read without it as a hint.
    namespace: Atomic(u16),
    /// Uses of the shard since it was installed in this slot, saturating at the u16 maximum:
    /// Gets that found the key resident (`hit`, `waiter` of a fill, `held` by the caller
    /// already: a pin, a flush or admission claim, another task of its own; a pin is a Get).
    /// Not counted: the Get that installs the slot or takes an idle one over (`owner`),
    /// look-ups, touches, prealloc, and `admit`'s own references. Reset when the slot is
    /// installed (for another key, or for the same key: a dump replacing a Ready copy removes
    /// it and claims afresh). Changed only under the bucket lock; `admit` reads it.
    reuses: Atomic(u16),

    pub fn refcount(slot: *const Slot) u32 {
        return @popCount(slot.holders.load(.monotonic));
    }
};

/// One registered process. `tag` packs (state << 32 | pid) so that a state change and the pid
/// it applies to are one CAS.
pub const HolderEntry = extern struct {
    tag: Atomic(u64),
    /// /proc/<pid>/stat field 22 of the holder: a reused pid has another start time.
    start_time: Atomic(u64),
    /// Pid of the process sweeping this dead holder's references; 0 when nobody is.
    reclaimer: Atomic(u32),
    /// 1 once the process started closing the buffer (`mark_closing`): the last process to
    /// close, the one that sees no other live holder that is not closing, pays the debt.
    closing: Atomic(u32),
    _pad1: u64,

    pub fn state(entry: *const HolderEntry) HolderState {
        return @enumFromInt(@as(u32, @intCast(entry.tag.load(.acquire) >> 32)));
    }

    pub fn pid(entry: *const HolderEntry) u32 {
        return @truncate(entry.tag.load(.acquire));
    }
};

/// One namespace of the table. `tag` and the quotas are written once per registration
/// (before `state` turns live, release); `occupancy_slots` changes under bucket locks.
pub const NamespaceEntry = extern struct {
    /// The namespace's tag (first 8 bytes of its keys, little-endian); 0 for entry 0.
    tag: Atomic(u64),
    state: Atomic(u32),
    /// Slots other namespaces' inserts never take below.
    guarantee_slots: Atomic(u32),
    /// Most slots the namespace holds; at it, an insert evicts one of its own.
    cap_slots: Atomic(u32),
    /// Slots linked into a chain with `Slot.namespace` == index + 1.
    occupancy_slots: Atomic(u32),
    /// Gets of this namespace's keys that found them Ready, or not (the buffer's `hits` and
    /// `misses`, per namespace), and its Ready slots evicted (for any namespace's insert).
    hits: Atomic(u64),
    misses: Atomic(u64),
    evictions: Atomic(u64),
    _pad: [16]u8,
};

pub const NamespaceState = enum(u32) { free = 0, registering = 1, live = 2 };

fn name_to_words(name: []const u8) [name_words]u64 {
    assert(name.len <= constants.buffer_namespace_name_max_bytes);
    var bytes: [constants.buffer_namespace_name_max_bytes]u8 = @splat(0);
    @memcpy(bytes[0..name.len], name);
    var words: [name_words]u64 = undefined;
    for (&words, 0..) |*word, index| word.* = std.mem.readInt(u64, bytes[index * 8 ..][0..8], .little);
    return words;
}

pub const Namespaces = extern struct {
    entries: [constants.buffer_namespaces_max]NamespaceEntry,
};

/// One control record: a name and the largest value ever raised to under it.
pub const ControlEntry = extern struct {
    /// Written once, while the entry is `registering`, before it turns live (release).
    name: [constants.buffer_control_name_size_bytes]u8,
    state: Atomic(u32),
    _pad0: u32,
    value: Atomic(u64),
};

pub const Controls = extern struct {
    entries: [constants.buffer_controls_max]ControlEntry,
};

const name_words = constants.buffer_namespace_name_max_bytes / 8;

/// One namespace identity: its tag and its name. The tag is claimed (0: free) and the name
/// written under the registration lock; `name_len_bytes` is stored last (release), so a reader
/// that sees it non-zero sees the whole name. Never changes once complete.
pub const NamespaceName = extern struct {
    tag: Atomic(u64),
    /// 0 until the name is complete (a registrant killed mid-write leaves 0; the next
    /// registrant of the tag completes it).
    name_len_bytes: Atomic(u32),
    _pad0: u32,
    /// The name's bytes, little-endian in 8-byte words, zero-padded.
    name: [name_words]Atomic(u64),
    _pad1: [48]u8,
};

pub const NamespaceNames = extern struct {
    /// The registration lock: 0 or the holder's pid (with `lock_contended_bit`), as a bucket
    /// lock. Held for every change to this table and to the namespace (quota) table.
    lock: Atomic(u32),
    /// Entries whose tag is claimed.
    used: Atomic(u32),
    _pad: [56]u8,
    entries: [constants.buffer_namespace_names_max]NamespaceName,
};

/// What a namespace-aware allocation may take: free slots and any victim (`grow`), or only
/// the inserting namespace's own slots (it is at its cap).
const Quota = struct { namespace: u16, grow: bool };

pub const Holders = extern struct {
    /// Bit h set: holder h is dead and its references are being dropped. Read under a bucket
    /// lock before clearing a slot's bits: the bit is cleared before the entry is freed, so a
    /// new holder reusing index h is never mistaken for the dead one.
    dead_mask: Atomic(u64),
    /// Monotonic time of the last scan triggered by a full buffer (rate limit).
    last_scan_ns: Atomic(u64),
    _pad: [48]u8,
    entries: [constants.buffer_holders_max]HolderEntry,
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
    assert(@offsetOf(Slot, "reuses") == 62);
    assert(slot_flag_admitted_shift + admission_tiers_max <= slot_flag_matured_shift);
    assert(slot_flag_matured_shift + admission_tiers_max <= 32);
    assert(@offsetOf(Slot, "holders") % 8 == 0);
    assert(@sizeOf(HolderEntry) == constants.buffer_holder_entry_size_bytes);
    assert(@sizeOf(Holders) == constants.buffer_holder_table_size_bytes);
    assert(@sizeOf(NamespaceEntry) == constants.buffer_namespace_entry_size_bytes);
    assert(@sizeOf(Namespaces) == constants.buffer_namespace_table_size_bytes);
    assert(@sizeOf(NamespaceName) == constants.buffer_namespace_name_entry_size_bytes);
    assert(@sizeOf(NamespaceNames) == constants.buffer_namespace_names_size_bytes);
    assert(@offsetOf(NamespaceNames, "entries") == constants.buffer_namespace_names_header_size_bytes);
    assert(@offsetOf(NamespaceNames, "lock") % constants.futex_word_size_bytes == 0);
    assert(@offsetOf(Slot, "namespace") == 60);
    assert(@sizeOf(ControlEntry) == constants.buffer_control_entry_size_bytes);
    assert(@sizeOf(Controls) == constants.buffer_control_table_size_bytes);
    assert(@offsetOf(ControlEntry, "value") % 8 == 0);
    assert(@offsetOf(Slot, "version") % constants.futex_word_size_bytes == 0);
    assert(@offsetOf(Bucket, "lock") % constants.futex_word_size_bytes == 0);
    assert(removals_offset_bytes % constants.buffer_cache_line_bytes == 0);
}

const clock_offset_bytes = constants.buffer_header_size_bytes;
const counters_offset_bytes = clock_offset_bytes + constants.buffer_clock_size_bytes;
const holders_offset_bytes = counters_offset_bytes + constants.buffer_counters_size_bytes;
const namespaces_offset_bytes = holders_offset_bytes + constants.buffer_holder_table_size_bytes;
const names_offset_bytes = namespaces_offset_bytes + constants.buffer_namespace_table_size_bytes;
const controls_offset_bytes = names_offset_bytes + constants.buffer_namespace_names_size_bytes;
const removals_offset_bytes = controls_offset_bytes + constants.buffer_control_table_size_bytes;
const buckets_offset_bytes = removals_offset_bytes + constants.removal_log_size_bytes;

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
    /// Every holder entry is taken by a live process.
    holders_full = -107,
    /// The holder index is not registered to the calling process (e.g. after fork()).
    not_registered = -108,
    /// Every namespace entry is taken (`constants.buffer_namespaces_max`).
    namespaces_full = -109,
    /// The guarantees of the registered namespaces would exceed the regular slots.
    guarantees_over = -110,
    /// Every control record entry is taken (`constants.buffer_controls_max`).
    controls_full = -111,
    /// Every namespace identity entry is taken (`constants.buffer_namespace_names_max`).
    names_full = -112,
    /// The tag is entered under another name (two names hashed to one tag).
    name_conflict = -113,
};

pub const GetResult = enum(u8) {
    hit = 0,
    owner = 1,
    waiter = 2,
    no_slot = 3,
    lock_timeout = 4,
    /// The caller already holds a reference on the key's slot (one per holder): nothing taken.
    held = 5,
    /// `GetMode.lookup` only: the key is not Ready and nobody fills it (no slot, or an idle
    /// one nobody holds: Prealloc's, or one an owner gave up): nothing taken, nothing evicted.
    absent = 6,
};

/// What `get` does with a key that is not Ready and that nobody fills.
pub const GetMode = enum {
    /// Claim a slot for it (a fresh one, a CLOCK victim, or an idle one resident): the caller
    /// becomes its owner and fills it.
    claim,
    /// Look it up only (a no-fill load, which never fills a key): `absent`. Never allocates,
    /// never evicts, never takes an idle slot over (a Prealloc stays for a load that fills).
    /// Hits, waiters and held slots are the same as `claim`'s.
    lookup,
    /// A dump's claim: `claim`'s results, but a Ready copy it meets (hit, or held already)
    /// counts no use (`Slot.reuses`): writing a block is not reading it, so a re-dump never
    /// admits it. Waiting for another rank's load of it is a use, as for `claim`.
    write,
};

/// What `wait` reports per slot. `idle` means the timeout expired with the owner alive.
pub const WaitResult = enum(u8) {
    idle = 0,
    ready = 1,
    failed = 2,
    takeover = 3,
    lock_timeout = 4,
    missing = 5,
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

/// Test hook (process-local): decides whether (pid, start time) is alive instead of /proc, so
/// the fuzzer can run many simulated processes in one.
pub var debug_identity_alive: ?*const fn (pid: u32, start_time: u64) bool = null;

/// Whether the process (pid, start time) still runs: a zombie or a reused pid is dead.
pub fn identity_alive(pid: u32, start_time: u64) bool {
    assert(pid != 0);
    if (debug_identity_alive) |hook| return hook(pid, start_time);
    const found = seg_sys.process_start_time_ticks(pid) orelse return false;
    return found == start_time;
}

/// Start time of this process, cached per pid (a forked child reads its own).
var self_start_pid: u32 = 0;
var self_start_time: u64 = 0;

pub fn self_start_time_ticks(pid: u32) u64 {
    if (@atomicLoad(u32, &self_start_pid, .acquire) == pid) {
        return @atomicLoad(u64, &self_start_time, .monotonic);
    }
    const start = seg_sys.process_start_time_ticks(pid) orelse
        std.debug.panic("cannot read /proc/{d}/stat of this process", .{pid});
    @atomicStore(u64, &self_start_time, start, .monotonic);
    @atomicStore(u32, &self_start_pid, pid, .release);
    return start;
}

pub const Buffer = struct {
    header: *Header,
    clock: *Clock,
    counters: *Counters,
    holder_table: *Holders,
    namespace_table: *Namespaces,
    control_table: *Controls,
    /// The node's removal log (removal_log.zig): purges and forced removes, for writers.
    removal_log: *removal_log.Log,
    namespace_names: *NamespaceNames,
    buckets: []Bucket,
    slots: []Slot,
    geometry: Geometry,
    pid: u32,
    /// This process's holder index (`register`), or `holder_none` for a view that takes no
    /// references (lookups, touch, remove, stats).
    holder: u32 = holder_none,

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
        for (&buffer.holder_table.entries) |*entry| {
            entry.tag = Atomic(u64).init(holder_tag(.free, 0));
            entry.reclaimer = Atomic(u32).init(0);
        }
        // Entry 0, the default namespace: live from the start, no guarantee, no cap.
        const default_entry = &buffer.namespace_table.entries[0];
        default_entry.state = Atomic(u32).init(@intFromEnum(NamespaceState.live));
        default_entry.cap_slots = Atomic(u32).init(geometry.slot_count_total());
        buffer.removal_log.init();
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
            .holder_table = @ptrFromInt(ctrl_base + holders_offset_bytes),
            .namespace_table = @ptrFromInt(ctrl_base + namespaces_offset_bytes),
            .control_table = @ptrFromInt(ctrl_base + controls_offset_bytes),
            .removal_log = @ptrFromInt(ctrl_base + removals_offset_bytes),
            .namespace_names = @ptrFromInt(ctrl_base + names_offset_bytes),
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
    /// Where the slots are (the metrics' occupancy gauges), read without locks while ranks
    /// work: each slot is read once, so every slot is counted consistently but the sums may
    /// mix instants; a gauge, not an audit. The one reader of the slot table's layout besides
    /// the operations themselves (Python asks for this instead of walking the table).
    pub fn occupancy(buffer: Buffer) Occupancy {
        var out = Occupancy{};
        const regular = buffer.geometry.slot_count_regular;
        for (buffer.slots, 0..) |*slot, index| {
            // Monotonic: a gauge; nothing is ordered by these reads.
            const bucket = slot.bucket.load(.monotonic);
            const state = slot.state.load(.monotonic);
            const flags = slot.flags.load(.monotonic);
            const held: u64 = @popCount(slot.holders.load(.monotonic));
            if (held > 0) out.in_use += 1;
            if (bucket == slot_none) {
                out.free += 1;
            } else if (bucket == bucket_detached) {
                out.detached += 1;
            } else if (state == @intFromEnum(State.ready)) {
                out.resident += 1;
                if (index >= regular) out.resident_reserved += 1;
            } else if (held > 0) {
                out.filling += 1;
                out.waiters += held - 1;
            } else if (flags & slot_flag_preallocated != 0) {
                out.preallocated += 1;
            }
        }
        assert(out.free + out.detached + out.resident <= buffer.slots.len);
        return out;
    }

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
    // Holders: who may hold references, and recovery of the references of dead processes.

    /// Registers (pid, start_time) and returns its holder index; idempotent for a live entry of
    /// the same identity. When the table is full, dead holders are reclaimed first.
    pub fn register_identity(buffer: Buffer, pid: u32, start_time: u64) error{ HoldersFull, LockTimeout }!u32 {
        assert(pid != 0 and pid <= lock_pid_mask);
        const table = buffer.holder_table;
        var attempt: u32 = 0;
        while (attempt < 2) : (attempt += 1) {
            for (&table.entries, 0..) |*entry, index| {
                if (entry.tag.load(.acquire) != holder_tag(.live, pid)) continue;
                if (entry.start_time.load(.monotonic) == start_time) return @intCast(index);
                // Our pid with another start time: a dead predecessor whose pid we reuse.
                buffer.mark_dead(@intCast(index), pid);
            }
            for (&table.entries, 0..) |*entry, index| {
                // Acquire: the previous reclaimer's clearing of dead_mask happened before.
                if (entry.tag.cmpxchgStrong(holder_tag(.free, 0), holder_tag(.registering, pid), .acquire, .monotonic) != null) continue;
                entry.start_time.store(start_time, .monotonic);
                entry.closing.store(0, .monotonic);
                // Release: the start time and closing word are visible to whoever sees the
                // entry live.
                entry.tag.store(holder_tag(.live, pid), .release);
                return @intCast(index);
            }
            if (attempt == 0) _ = try buffer.reclaim_dead();
        }
        return error.HoldersFull;
    }

    /// Registers the calling process (see `register_identity`).
    pub fn register(buffer: Buffer) error{ HoldersFull, LockTimeout }!u32 {
        return buffer.register_identity(buffer.pid, self_start_time_ticks(buffer.pid));
    }

    /// Whether `holder` is this view's registered process (forked children are not).
    pub fn holder_valid(buffer: Buffer, holder: u32) bool {
        if (holder >= constants.buffer_holders_max) return false;
        return buffer.holder_table.entries[holder].tag.load(.acquire) == holder_tag(.live, buffer.pid);
    }

    /// Marks a live entry dead (once) so that everyone drops its references.
    fn mark_dead(buffer: Buffer, holder: u32, pid: u32) void {
        const entry = &buffer.holder_table.entries[holder];
        if (entry.tag.cmpxchgStrong(holder_tag(.live, pid), holder_tag(.dead, pid), .acq_rel, .monotonic) == null) {
            // Release: pairs with the loads of dead_mask under bucket locks.
            _ = buffer.holder_table.dead_mask.fetchOr(holder_bit(holder), .release);
            buffer.count(.dead_holders, 1);
        }
    }

    /// Whether holder `holder` still runs; marks it dead when it does not.
    pub fn holder_alive(buffer: Buffer, holder: u32) bool {
        assert(holder < constants.buffer_holders_max);
        const entry = &buffer.holder_table.entries[holder];
        const tag = entry.tag.load(.acquire);
        const pid: u32 = @truncate(tag);
        switch (@as(HolderState, @enumFromInt(@as(u32, @intCast(tag >> 32))))) {
            .free, .dead => return false,
            .registering => return pid_alive(pid),
            .live => {
                if (pid == buffer.pid and holder == buffer.holder) return true;
                if (identity_alive(pid, entry.start_time.load(.monotonic))) return true;
                buffer.mark_dead(holder, pid);
                return false;
            },
        }
    }

    /// Checks every live holder (pid + start time) and marks the dead ones. Returns dead_mask.
    pub fn scan_holders(buffer: Buffer) u64 {
        for (&buffer.holder_table.entries, 0..) |*entry, index| {
            const tag = entry.tag.load(.acquire);
            const pid: u32 = @truncate(tag);
            const state: HolderState = @enumFromInt(@as(u32, @intCast(tag >> 32)));
            if (state == .live) {
                _ = buffer.holder_alive(@intCast(index));
            } else if (state == .registering and !pid_alive(pid)) {
                // Died before it could take a reference: nothing to sweep.
                _ = entry.tag.cmpxchgStrong(tag, holder_tag(.free, 0), .acq_rel, .monotonic);
            }
        }
        return buffer.holder_table.dead_mask.load(.acquire);
    }

    /// A scan at most every `buffer_holder_scan_interval_ns` (a full buffer asks on every miss).
    fn scan_holders_rate_limited(buffer: Buffer) u64 {
        const now_ns = futex.monotonic_ns();
        const last = buffer.holder_table.last_scan_ns.load(.monotonic);
        if (last != 0 and now_ns -| last < constants.buffer_holder_scan_interval_ns) {
            return buffer.holder_table.dead_mask.load(.acquire);
        }
        if (buffer.holder_table.last_scan_ns.cmpxchgStrong(last, now_ns, .monotonic, .monotonic) != null) {
            return buffer.holder_table.dead_mask.load(.acquire);
        }
        return buffer.scan_holders();
    }

    /// Whether the process whose pid is in a lock word runs: through its holder entry (pid +
    /// start time) when it has one, else by pid.
    pub fn lock_holder_alive(buffer: Buffer, pid: u32) bool {
        // A reused pid may name two entries (the dead process's, not yet marked, and the new
        // one's): the locker is alive if any entry of that pid is.
        var found = false;
        for (&buffer.holder_table.entries, 0..) |*entry, index| {
            const tag = entry.tag.load(.acquire);
            if (@as(u32, @truncate(tag)) != pid) continue;
            const state: HolderState = @enumFromInt(@as(u32, @intCast(tag >> 32)));
            if (state == .free) continue;
            found = true;
            if (state != .dead and buffer.holder_alive(@intCast(index))) return true;
        }
        return !found and pid_alive(pid);
    }

    /// Drops the references of dead holders from a slot. The caller holds the slot's bucket
    /// lock. Returns whether the slot is now unreferenced.
    fn drop_dead_refs_locked(buffer: Buffer, slot_index: u32) bool {
        const slot = &buffer.slots[slot_index];
        const holders = slot.holders.load(.monotonic);
        if (holders == 0) return true;
        // Monotonic under the bucket lock suffices: see Holders.dead_mask.
        const dead = buffer.holder_table.dead_mask.load(.acquire);
        const stale = holders & dead;
        if (stale == 0) return false;
        buffer.drop_refs_locked(slot_index, stale);
        return holders & ~stale == 0;
    }

    fn drop_refs_locked(buffer: Buffer, slot_index: u32, stale: u64) void {
        const slot = &buffer.slots[slot_index];
        assert(stale != 0);
        _ = slot.holders.fetchAnd(~stale, .monotonic);
        const owner = slot.owner.load(.monotonic);
        if (owner != 0 and stale & holder_bit(owner - 1) != 0) {
            // The owner died mid-load: waiters see owner 0 and take over.
            slot.owner.store(0, .monotonic);
        }
        const flusher = slot.flusher.load(.monotonic);
        if (flusher != 0 and stale & holder_bit(flusher - 1) != 0) {
            // The flusher died mid-write: the slot stays dirty for the next flusher.
            slot.flusher.store(0, .monotonic);
        }
        buffer.count(.refs_reclaimed, @popCount(stale));
    }

    pub const Reclaim = struct { holders: u32 = 0, refs: u64 = 0 };

    /// Finds dead holders, drops every reference they left (one slot, one bucket lock at a
    /// time: the sweep never holds a lock for more than a slot), recovers locks they held, and
    /// frees their entries. Bounded by the slot and bucket counts. A sweep interrupted by its
    /// own death is taken over by the next caller.
    pub fn reclaim_dead(buffer: Buffer) error{LockTimeout}!Reclaim {
        _ = buffer.scan_holders();
        const table = buffer.holder_table;
        var claimed: u64 = 0;
        var claimed_pids: [constants.buffer_holders_max]u32 = @splat(0);
        for (&table.entries, 0..) |*entry, index| {
            const tag = entry.tag.load(.acquire);
            if (tag >> 32 != @intFromEnum(HolderState.dead)) continue;
            const reclaimer = entry.reclaimer.load(.monotonic);
            if (reclaimer == buffer.pid) continue; // our own sweep in another thread
            if (reclaimer != 0 and pid_alive(reclaimer)) continue;
            if (entry.reclaimer.cmpxchgStrong(reclaimer, buffer.pid, .acq_rel, .monotonic) != null) continue;
            claimed |= holder_bit(@intCast(index));
            claimed_pids[index] = @truncate(tag);
        }
        var report = Reclaim{};
        if (claimed == 0) return report;
        // Locks left held by the dead: lock_acquire steals and repairs them.
        for (buffer.buckets, 0..) |*bucket, bucket_index| {
            const holder_pid = bucket.lock.load(.monotonic) & lock_pid_mask;
            if (holder_pid == 0) continue;
            if (std.mem.indexOfScalar(u32, &claimed_pids, holder_pid) == null) continue;
            try buffer.lock_acquire(@intCast(bucket_index));
            buffer.lock_release(@intCast(bucket_index));
        }
        for (0..buffer.slots.len) |slot_index| {
            report.refs += try buffer.sweep_slot(@intCast(slot_index), claimed);
        }
        for (&table.entries, 0..) |*entry, index| {
            if (claimed & holder_bit(@intCast(index)) == 0) continue;
            // Order: dead bit off, then the entry free (release), then the claim dropped.
            _ = table.dead_mask.fetchAnd(~holder_bit(@intCast(index)), .release);
            entry.tag.store(holder_tag(.free, 0), .release);
            entry.reclaimer.store(0, .monotonic);
            report.holders += 1;
        }
        buffer.count(.holders_freed, report.holders);
        // A dead process may have died between a slot's namespace field and its counter.
        try buffer.recount_namespaces();
        return report;
    }

    /// Clears the bits in `mask` (claimed dead holders) from one slot. Returns refs dropped.
    fn sweep_slot(buffer: Buffer, slot_index: u32, mask: u64) error{LockTimeout}!u64 {
        const slot = &buffer.slots[slot_index];
        var attempts: u32 = 0;
        while (attempts < 4) : (attempts += 1) {
            // Dead holders never set new bits, so a slot without them can be skipped unlocked.
            if (slot.holders.load(.acquire) & mask == 0) return 0;
            const bucket_index = slot.bucket.load(.acquire);
            if (bucket_index == bucket_free) return 0;
            if (bucket_index == bucket_detached) {
                // AcqRel: whoever clears the last bit frees the slot (as in release_one).
                const previous = slot.holders.fetchAnd(~mask, .acq_rel);
                const stale = previous & mask;
                if (stale != 0) buffer.count(.refs_reclaimed, @popCount(stale));
                // A dead owner (or flusher) leaves its role here too, as in drop_refs_locked:
                // the entries are freed next, and a new process may register into the dead
                // owner's index; waiters on this (force-removed, still Idle) slot would then
                // judge that new process as the owner and never take over. Found by the
                // fuzzer. CAS: a waiter may take the slot over (owner dead -> itself) meanwhile.
                const owner = slot.owner.load(.monotonic);
                if (owner != 0 and stale & holder_bit(owner - 1) != 0) {
                    _ = slot.owner.cmpxchgStrong(owner, 0, .monotonic, .monotonic);
                }
                const flusher = slot.flusher.load(.monotonic);
                if (flusher != 0 and stale & holder_bit(flusher - 1) != 0) {
                    _ = slot.flusher.cmpxchgStrong(flusher, 0, .monotonic, .monotonic);
                }
                if (stale != 0 and previous & ~mask == 0) buffer.free_slot(slot_index);
                return @popCount(stale);
            }
            assert(bucket_index < buffer.buckets.len);
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            if (slot.bucket.load(.monotonic) != bucket_index) continue;
            const stale = slot.holders.load(.monotonic) & mask;
            if (stale == 0) return 0;
            buffer.drop_refs_locked(slot_index, stale);
            return @popCount(stale);
        }
        return 0;
    }

    /// Test hook: overwrite a holder's recorded start time, as if its pid had been reused.
    pub fn debug_set_start_time(buffer: Buffer, holder: u32, start_time: u64) void {
        assert(holder < constants.buffer_holders_max);
        buffer.holder_table.entries[holder].start_time.store(start_time, .monotonic);
    }

    // ---------------------------------------------------------------------------------------
    // Control records: named monotonic maxima (reset epochs), outside every slot.

    pub const ControlName = [constants.buffer_control_name_size_bytes]u8;

    /// The largest value raised under `name`, or null when no entry holds it.
    pub fn control_read(buffer: Buffer, name: *const ControlName) ?u64 {
        var found: ?u64 = null;
        for (&buffer.control_table.entries) |*entry| {
            // Acquire: pairs with the release that publishes the entry's name and value.
            if (entry.state.load(.acquire) != @intFromEnum(NamespaceState.live)) continue;
            if (!std.mem.eql(u8, &entry.name, name)) continue;
            // Acquire: pairs with the raise's acq_rel maximum (a value read is a value raised).
            const value = entry.value.load(.acquire);
            found = @max(found orelse 0, value);
        }
        return found;
    }

    /// Raises record `name` to at least `value` (a monotonic maximum), registering it when no
    /// entry holds it; returns the record's value after the raise.
    pub fn control_raise(buffer: Buffer, name: *const ControlName, value: u64) error{ControlsFull}!u64 {
        const table = &buffer.control_table.entries;
        var raised: ?u64 = null;
        for (table) |*entry| {
            if (entry.state.load(.acquire) != @intFromEnum(NamespaceState.live)) continue;
            if (!std.mem.eql(u8, &entry.name, name)) continue;
            // AcqRel: the maximum is one atomic read-modify-write (no retry loop), ordered
            // after the caller's earlier writes and before its later reads of the record.
            const before = entry.value.fetchMax(value, .acq_rel);
            raised = @max(raised orelse 0, @max(before, value));
        }
        if (raised) |result| return buffer.control_read(name) orelse result;
        for (table) |*entry| {
            // Acquire on success: nothing to see; the entry is ours to write.
            if (entry.state.cmpxchgStrong(
                @intFromEnum(NamespaceState.free),
                @intFromEnum(NamespaceState.registering),
                .acquire,
                .monotonic,
            ) != null) continue;
            assert(entry.value.load(.monotonic) == 0);
            entry.name = name.*;
            entry.value.store(value, .monotonic);
            // Release: whoever sees the entry live sees its name and first value.
            entry.state.store(@intFromEnum(NamespaceState.live), .release);
            const result = buffer.control_read(name);
            assert(result != null and result.? >= value);
            return result.?;
        }
        return error.ControlsFull;
    }

    // ---------------------------------------------------------------------------------------
    // Namespaces: the table, the occupancy counters, the recount after a death.

    /// Registers namespace `tag` with its quotas (or updates them), returning its index. Tag 0
    /// is the default namespace (entry 0). Entries are never freed: a tag keeps its index for
    /// the region's life. Under the registration lock: two processes registering one new tag
    /// at once take one entry, and the guarantee sum is checked and committed together.
    pub fn register_namespace(
        buffer: Buffer,
        tag: u64,
        guarantee_slots: u32,
        cap_slots: u32,
    ) error{ InvalidArgument, NamespacesFull, GuaranteesOver, LockTimeout }!u16 {
        if (guarantee_slots > cap_slots) return error.InvalidArgument;
        if (cap_slots > buffer.geometry.slot_count_total()) return error.InvalidArgument;
        try buffer.registration_lock_acquire();
        defer buffer.registration_lock_release();
        const table = &buffer.namespace_table.entries;
        const existing: ?u16 = if (tag == 0) 0 else buffer.namespace_find(tag);
        var guaranteed: u64 = guarantee_slots;
        for (table, 0..) |*entry, index| {
            if (existing != null and index == existing.?) continue;
            if (entry.state.load(.acquire) != @intFromEnum(NamespaceState.live)) continue;
            guaranteed += entry.guarantee_slots.load(.monotonic);
        }
        if (guaranteed > buffer.geometry.slot_count_regular) return error.GuaranteesOver;
        if (existing) |index| {
            // Monotonic: quotas are limits read as hints; the occupancy CAS enforces them.
            table[index].guarantee_slots.store(guarantee_slots, .monotonic);
            table[index].cap_slots.store(cap_slots, .monotonic);
            return index;
        }
        for (table[1..], 1..) |*entry, index| {
            // Under the lock, an entry still `registering` was left by a registrant killed
            // before it went live: no key ever counted in it, so it is free to take.
            if (entry.state.load(.monotonic) == @intFromEnum(NamespaceState.live)) continue;
            entry.state.store(@intFromEnum(NamespaceState.registering), .monotonic);
            assert(entry.occupancy_slots.load(.monotonic) == 0);
            entry.tag.store(tag, .monotonic);
            entry.guarantee_slots.store(guarantee_slots, .monotonic);
            entry.cap_slots.store(cap_slots, .monotonic);
            // Release: whoever sees the entry live sees its tag and quotas.
            entry.state.store(@intFromEnum(NamespaceState.live), .release);
            return @intCast(index);
        }
        return error.NamespacesFull;
    }

    /// Enters namespace `tag` (not 0) with its `name` in the identity table, returning the
    /// entry's index. Idempotent; one entry per tag, whoever registers it at once. NamesFull
    /// when every entry is taken, NameConflict when the tag is entered under another name.
    pub fn register_namespace_name(
        buffer: Buffer,
        tag: u64,
        name: []const u8,
    ) error{ InvalidArgument, NamesFull, NameConflict, LockTimeout }!u32 {
        if (tag == 0) return error.InvalidArgument;
        if (name.len == 0 or name.len > constants.buffer_namespace_name_max_bytes) {
            return error.InvalidArgument;
        }
        const words = name_to_words(name);
        // Lock-free first: every registration after the first of a tag ends here.
        if (buffer.namespace_name_find(tag)) |index| {
            if (!buffer.namespace_name_equals(index, &words, name.len)) return error.NameConflict;
            return index;
        }
        try buffer.registration_lock_acquire();
        defer buffer.registration_lock_release();
        const entries = &buffer.namespace_names.entries;
        const mask = constants.buffer_namespace_names_max - 1;
        const start: u32 = @as(u32, @truncate(tag)) & mask;
        var probe: u32 = 0;
        while (probe < constants.buffer_namespace_names_max) : (probe += 1) {
            const index = (start + probe) & mask;
            const entry = &entries[index];
            // Monotonic: tags change only under the lock we hold.
            const seen = entry.tag.load(.monotonic);
            if (seen == 0) {
                entry.tag.store(tag, .monotonic);
                _ = buffer.namespace_names.used.fetchAdd(1, .monotonic);
            } else if (seen != tag) {
                continue;
            } else if (entry.name_len_bytes.load(.monotonic) != 0) {
                if (!buffer.namespace_name_equals(index, &words, name.len)) return error.NameConflict;
                return index;
            }
            // A new entry, or one whose registrant died before publishing its name.
            for (&entry.name, words) |*word, value| word.store(value, .monotonic);
            // Release: whoever reads the length non-zero reads the name and the tag.
            entry.name_len_bytes.store(@intCast(name.len), .release);
            return index;
        }
        return error.NamesFull;
    }

    /// The complete identity entry of `tag` (not 0), if any. Lock-free: entries are never
    /// freed, so the probe stops at the first free one.
    pub fn namespace_name_find(buffer: Buffer, tag: u64) ?u32 {
        assert(tag != 0);
        const entries = &buffer.namespace_names.entries;
        const mask = constants.buffer_namespace_names_max - 1;
        const start: u32 = @as(u32, @truncate(tag)) & mask;
        var probe: u32 = 0;
        while (probe < constants.buffer_namespace_names_max) : (probe += 1) {
            const index = (start + probe) & mask;
            const entry = &entries[index];
            // Monotonic: the tag alone publishes nothing; the length's acquire below does.
            const seen = entry.tag.load(.monotonic);
            if (seen == 0) return null;
            if (seen != tag) continue;
            // Acquire: pairs with the release store of the length; the name is complete.
            if (entry.name_len_bytes.load(.acquire) == 0) return null;
            return index;
        }
        return null;
    }

    fn namespace_name_equals(buffer: Buffer, index: u32, words: *const [name_words]u64, len: usize) bool {
        const entry = &buffer.namespace_names.entries[index];
        // Acquire: pairs with the release store of the length (the name words before it).
        if (entry.name_len_bytes.load(.acquire) != len) return false;
        for (&entry.name, words) |*word, value| {
            if (word.load(.monotonic) != value) return false;
        }
        return true;
    }

    /// A snapshot of identity entry `index`: its length is 0 while it is not complete.
    pub fn namespace_name_copy(buffer: Buffer, index: u32, out: *NamespaceName) void {
        assert(index < constants.buffer_namespace_names_max);
        const entry = &buffer.namespace_names.entries[index];
        // Acquire: pairs with the release store of the length; the words after it are whole.
        const len = entry.name_len_bytes.load(.acquire);
        out.* = .{
            .tag = .init(entry.tag.load(.monotonic)),
            .name_len_bytes = .init(len),
            ._pad0 = 0,
            .name = undefined,
            ._pad1 = @splat(0),
        };
        for (&out.name, &entry.name) |*to, *from| to.* = .init(if (len == 0) 0 else from.load(.monotonic));
    }

    /// The live entry of `tag` (not 0), if any: the first one.
    fn namespace_find(buffer: Buffer, tag: u64) ?u16 {
        assert(tag != 0);
        for (buffer.namespace_table.entries[1..], 1..) |*entry, index| {
            // Acquire: pairs with the release store that made the entry live.
            if (entry.state.load(.acquire) != @intFromEnum(NamespaceState.live)) continue;
            if (entry.tag.load(.monotonic) == tag) return @intCast(index);
        }
        return null;
    }

    /// The namespace index a key counts in: its tag's entry, else 0 (the default namespace).
    pub fn namespace_of(buffer: Buffer, block_id: *const BlockId) u16 {
        const tag = std.mem.readInt(u64, block_id[0..8], .little);
        if (tag == 0) return 0;
        return buffer.namespace_find(tag) orelse 0;
    }

    /// Counts a Get outcome or an eviction for the namespace a slot field (index + 1, or 0
    /// for the default) names.
    fn namespace_event(buffer: Buffer, field: u16, comptime event: enum { hit, miss, eviction }) void {
        assert(field <= constants.buffer_namespaces_max);
        const entry = &buffer.namespace_table.entries[if (field == 0) 0 else field - 1];
        const counter = switch (event) {
            .hit => &entry.hits,
            .miss => &entry.misses,
            .eviction => &entry.evictions,
        };
        // Monotonic: statistics order nothing else.
        _ = counter.fetchAdd(1, .monotonic);
    }

    pub fn namespace_occupancy(buffer: Buffer, index: u16) u32 {
        assert(index < constants.buffer_namespaces_max);
        return buffer.namespace_table.entries[index].occupancy_slots.load(.monotonic);
    }

    /// Counts a freshly linked slot in `index`. The caller holds the slot's bucket lock.
    fn namespace_count(buffer: Buffer, slot: *Slot, index: u16) void {
        assert(index < constants.buffer_namespaces_max);
        assert(slot.namespace.load(.monotonic) == 0);
        // Monotonic: the bucket lock orders the slot's field; the counter orders nothing.
        _ = buffer.namespace_table.entries[index].occupancy_slots.fetchAdd(1, .monotonic);
        slot.namespace.store(index + 1, .monotonic);
    }

    /// Stops counting a slot that leaves its chain. The caller holds the slot's bucket lock
    /// (or the slot exclusively).
    fn namespace_uncount(buffer: Buffer, slot: *Slot) void {
        const field = slot.namespace.load(.monotonic);
        if (field == 0) return;
        assert(field <= constants.buffer_namespaces_max);
        slot.namespace.store(0, .monotonic);
        const counter = &buffer.namespace_table.entries[field - 1].occupancy_slots;
        // Monotonic: as in namespace_count. A counter at 0 here is drift left by a kill
        // (repaired by the next recount), never a wrap.
        const previous = counter.load(.monotonic);
        if (previous > 0) _ = counter.fetchSub(1, .monotonic);
    }

    /// Whether a slot counted in namespace `field` - 1 may be taken by an insert under
    /// `quota` (a hint read without the victim's lock; `take_counted` decides).
    fn namespace_evictable(buffer: Buffer, field: u16, quota: Quota) bool {
        if (field == quota.namespace + 1) return true;
        if (!quota.grow) return false;
        if (field == 0) return true;
        const entry = &buffer.namespace_table.entries[field - 1];
        return entry.occupancy_slots.load(.monotonic) > entry.guarantee_slots.load(.monotonic);
    }

    /// Uncounts a victim for an insert under `quota`: its own namespace's slot always, another
    /// namespace's only while that one stays at or above its guarantee (a CAS, so two
    /// evictors never both take the last slot above it). The caller holds the victim's lock.
    fn take_counted(buffer: Buffer, slot: *Slot, quota: Quota) bool {
        const field = slot.namespace.load(.monotonic);
        if (field == 0) return quota.grow;
        if (field == quota.namespace + 1) {
            buffer.namespace_uncount(slot);
            return true;
        }
        if (!quota.grow) return false;
        const entry = &buffer.namespace_table.entries[field - 1];
        var attempts: u32 = 0;
        while (attempts < constants.buffer_cas_attempts_max) : (attempts += 1) {
            const slots_now = entry.occupancy_slots.load(.monotonic);
            if (slots_now <= entry.guarantee_slots.load(.monotonic)) return false;
            // Monotonic: the counter orders nothing; the CAS only keeps it above the guarantee.
            if (entry.occupancy_slots.cmpxchgWeak(slots_now, slots_now - 1, .monotonic, .monotonic) == null) {
                slot.namespace.store(0, .monotonic);
                return true;
            }
        }
        return false;
    }

    /// What an insert of `namespace` may take: anything while it is below its cap, else only
    /// its own slots.
    fn quota_for(buffer: Buffer, namespace: u16) Quota {
        const entry = &buffer.namespace_table.entries[namespace];
        const grow = entry.occupancy_slots.load(.monotonic) < entry.cap_slots.load(.monotonic);
        return .{ .namespace = namespace, .grow = grow };
    }

    /// Recounts every namespace from the chains, holding every bucket lock (taken in index
    /// order, so two recounts never deadlock; nobody else waits for a second lock): repairs the
    /// drift a process killed between a slot's field and its counter left. Bounded by the
    /// bucket and slot counts.
    pub fn recount_namespaces(buffer: Buffer) error{LockTimeout}!void {
        var locked: u32 = 0;
        defer {
            var index: u32 = 0;
            while (index < locked) : (index += 1) buffer.lock_release(index);
        }
        while (locked < buffer.buckets.len) : (locked += 1) try buffer.lock_acquire(locked);
        var counts: [constants.buffer_namespaces_max]u32 = @splat(0);
        for (buffer.slots) |*slot| slot.namespace.store(0, .monotonic);
        for (buffer.buckets) |*bucket| {
            var current = bucket.head;
            var steps: u32 = 0;
            while (current != slot_none) : (steps += 1) {
                assert(steps < buffer.slots.len);
                const slot = &buffer.slots[current];
                const index = buffer.namespace_of(&slot.block_id);
                slot.namespace.store(index + 1, .monotonic);
                counts[index] += 1;
                current = slot.next;
            }
        }
        for (&buffer.namespace_table.entries, counts) |*entry, value| {
            entry.occupancy_slots.store(value, .monotonic);
        }
    }

    // ---------------------------------------------------------------------------------------
    // Bucket locks: the word holds the holder's pid, so a lock left by a killed process is
    // recognised and stolen after a bounded wait.

    fn lock_try(buffer: Buffer, bucket_index: u32) bool {
        assert(bucket_index < buffer.buckets.len);
        if (buffer.word_lock_try(&buffer.buckets[bucket_index].lock)) {
            buffer.count(.lock_acquisitions, 1);
            return true;
        }
        return false;
    }

    fn lock_acquire(buffer: Buffer, bucket_index: u32) error{LockTimeout}!void {
        assert(bucket_index < buffer.buckets.len);
        const taken = try buffer.word_lock_acquire(&buffer.buckets[bucket_index].lock);
        buffer.count(.lock_acquisitions, 1);
        if (taken == .stolen) {
            buffer.count(.lock_recoveries, 1);
            buffer.repair_bucket(bucket_index);
        }
    }

    fn lock_release(buffer: Buffer, bucket_index: u32) void {
        assert(bucket_index < buffer.buckets.len);
        buffer.word_lock_release(&buffer.buckets[bucket_index].lock);
    }

    fn word_lock_try(buffer: Buffer, word: *Atomic(u32)) bool {
        // Acquire on success: what the previous holder wrote before its release store is
        // visible to us.
        return word.cmpxchgStrong(0, buffer.pid, .acquire, .monotonic) == null;
    }

    /// Takes a cross-process lock word (the holder's pid): spins briefly, then sleeps on the
    /// futex in slices, stealing it from a holder found dead. `.stolen`: the caller repairs
    /// what the dead holder left half-done.
    fn word_lock_acquire(buffer: Buffer, word: *Atomic(u32)) error{LockTimeout}!enum { free, stolen } {
        assert(buffer.pid != 0);
        var spins: u32 = 0;
        while (spins < constants.buffer_lock_spin_count) : (spins += 1) {
            if (buffer.word_lock_try(word)) return .free;
            std.atomic.spinLoopHint();
        }
        const deadline_ns = futex.monotonic_ns() + constants.buffer_lock_timeout_ns;
        var rounds: u32 = 0;
        while (rounds < constants.buffer_lock_round_max) : (rounds += 1) {
            const seen = word.load(.monotonic);
            if (seen == 0) {
                // Acquire: as in word_lock_try. We keep the contended bit since others may sleep.
                if (word.cmpxchgStrong(0, buffer.pid | lock_contended_bit, .acquire, .monotonic) == null) {
                    return .free;
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
                if (holder != buffer.pid and !buffer.lock_holder_alive(holder)) {
                    // Acquire: take over the dead holder's lock and whatever it left behind.
                    if (word.cmpxchgStrong(contended, buffer.pid | lock_contended_bit, .acquire, .monotonic) == null) {
                        return .stolen;
                    }
                }
            }
            if (futex.monotonic_ns() >= deadline_ns) return error.LockTimeout;
        }
        return error.LockTimeout;
    }

    fn word_lock_release(buffer: Buffer, word: *Atomic(u32)) void {
        // Release: publishes our writes to the next acquirer.
        const previous = word.swap(0, .release);
        assert(previous & lock_pid_mask == buffer.pid);
        if (previous & lock_contended_bit != 0) _ = futex.wake_all(word);
    }

    /// The registration lock of both namespace tables. What a dead holder left half-done needs
    /// no repair pass: an incomplete identity entry is completed by the next registrant of its
    /// tag, and a quota entry still `registering` is taken by the next new tag.
    fn registration_lock_acquire(buffer: Buffer) error{LockTimeout}!void {
        _ = try buffer.word_lock_acquire(&buffer.namespace_names.lock);
    }

    fn registration_lock_release(buffer: Buffer) void {
        buffer.word_lock_release(&buffer.namespace_names.lock);
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
            if (slot.holders.load(.monotonic) == 0) {
                buffer.free_slot(@intCast(index));
            } else {
                buffer.namespace_uncount(slot);
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
        assert(slot.holders.load(.monotonic) == 0);
        buffer.namespace_uncount(slot);
        slot.block_id = @splat(0);
        slot.shard_index = 0;
        slot.next = slot_none;
        // Monotonic: published by the release store of `bucket` below.
        slot.state.store(@intFromEnum(State.idle), .monotonic);
        slot.accessed.store(0, .monotonic);
        slot.owner.store(0, .monotonic);
        slot.flusher.store(0, .monotonic);
        slot.reuses.store(0, .monotonic);
        buffer.clear_dirty(slot);
        _ = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
        // Release: an allocator that CASes the bucket from free sees the cleared fields.
        slot.bucket.store(bucket_free, .release);
        assert(slot.next == slot_none);
    }

    /// Clears the slot's write-back debt, keeping the `dirty_slots` gauge equal to the number of
    /// dirty slots. The caller holds the slot's bucket lock (or the slot exclusively).
    fn clear_dirty(buffer: Buffer, slot: *Slot) void {
        // SeqCst: it pairs with a dirty commit's flag (see `commit`), which is set without the
        // bucket lock; acquiring it also orders our decrement after that commit's increment.
        const previous = slot.flags.fetchAnd(~slot_flag_dirty, .seq_cst);
        if (previous & slot_flag_dirty == 0) return;
        const gauge = buffer.counters.values[@intFromEnum(Counter.dirty_slots)].fetchSub(1, .monotonic);
        assert(gauge > 0);
    }

    // ---------------------------------------------------------------------------------------
    // Allocation: fresh (never used) slots first, then CLOCK second chance.

    const Pool = enum { regular, reserved };

    const Victim = struct { slot: u32 };

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
        assert(slot.holders.load(.monotonic) == 0);
        return true;
    }

    /// CLOCK over one pool: one lap of second chances (clearing bits), then one lap on the raw
    /// cursor taking the first slot not in use. Null when every slot is in use (or locked).
    fn clock_victim(buffer: Buffer, pool: Pool, bucket_index: u32, idle_only: bool, quota: Quota) ?Victim {
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
            if (buffer.try_evict(slot_index, bucket_index, second_chance, idle_only, quota)) |victim| {
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
        quota: Quota,
    ) ?Victim {
        assert(slot_index < buffer.slots.len);
        const slot = &buffer.slots[slot_index];
        // Quotas first: a slot the insert may not take keeps its second chance.
        if (!buffer.namespace_evictable(slot.namespace.load(.monotonic), quota)) return null;
        if (second_chance) {
            // Monotonic: the accessed bit is a hint; clearing it never breaks an invariant.
            if (slot.accessed.swap(0, .monotonic) != 0) return null;
        }
        // A slot referenced by a live holder is never a victim; one referenced only by dead
        // holders is, once their references are dropped under its bucket lock below.
        const holders = slot.holders.load(.monotonic);
        if (holders != 0 and holders & ~buffer.holder_table.dead_mask.load(.acquire) != 0) return null;
        // Write-back debt is paid by a flusher, never by eviction (re-checked under the lock).
        if (slot.flags.load(.monotonic) & slot_flag_dirty != 0) return null;
        const owner_bucket = slot.bucket.load(.monotonic);
        if (owner_bucket == bucket_free) {
            if (quota.grow and buffer.claim_free(slot_index, bucket_index)) return .{ .slot = slot_index };
            return null;
        }
        if (owner_bucket == bucket_detached) return null;
        assert(owner_bucket < buffer.buckets.len);
        const own_lock = owner_bucket == bucket_index;
        if (!own_lock and !buffer.lock_try(owner_bucket)) return null;
        defer if (!own_lock) buffer.lock_release(owner_bucket);
        // Re-check under the owning bucket's lock: references only grow under it.
        if (slot.bucket.load(.monotonic) != owner_bucket) return null;
        if (!buffer.drop_dead_refs_locked(slot_index)) return null;
        if (slot.flags.load(.monotonic) & slot_flag_dirty != 0) return null;
        const ready = slot.state.load(.monotonic) == @intFromEnum(State.ready);
        if (idle_only and ready) return null;
        const victim_field = slot.namespace.load(.monotonic);
        if (!buffer.take_counted(slot, quota)) return null;
        const victim = Victim{ .slot = slot_index };
        if (ready) {
            buffer.count(.evictions, 1);
            buffer.namespace_event(victim_field, .eviction);
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
        namespace: u16,
    ) void {
        const slot = &buffer.slots[slot_index];
        assert(slot.bucket.load(.monotonic) == bucket_index);
        assert(namespace == buffer.namespace_of(block_id));
        assert(slot.holders.load(.monotonic) == 0);
        assert(slot.flags.load(.monotonic) & slot_flag_dirty == 0); // Dirty slots are never victims.
        assert(!owner or buffer.holder < constants.buffer_holders_max);
        slot.block_id = block_id.*;
        slot.shard_index = shard_index;
        // Monotonic: every reader of these fields holds this bucket's lock or a reference
        // taken under it; the lock release publishes them.
        slot.state.store(@intFromEnum(State.idle), .monotonic);
        slot.owner.store(if (owner) buffer.holder + 1 else 0, .monotonic);
        slot.accessed.store(if (owner) 1 else 0, .monotonic);
        slot.reuses.store(0, .monotonic);
        if (owner) {
            _ = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
        } else {
            _ = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
            _ = slot.flags.fetchOr(slot_flag_preallocated, .monotonic);
        }
        buffer.link(bucket_index, slot_index);
        buffer.namespace_count(slot, namespace);
        if (owner) slot.holders.store(holder_bit(buffer.holder), .monotonic);
    }

    // ---------------------------------------------------------------------------------------
    // Operations. Each takes a batch; per-key outcomes go to caller arrays.

    pub const GetOutput = struct {
        results: []GetResult,
        slots: []u32,
    };

    pub fn get(
        buffer: Buffer,
        block_ids: []const BlockId,
        shard_indices: []const u32,
        out: GetOutput,
    ) void {
        buffer.get_as(.claim, block_ids, shard_indices, out);
    }

    /// `get` in `mode`: `.lookup` answers `absent` where `.claim` would take a slot.
    pub fn get_as(
        buffer: Buffer,
        mode: GetMode,
        block_ids: []const BlockId,
        shard_indices: []const u32,
        out: GetOutput,
    ) void {
        assert(block_ids.len == shard_indices.len);
        assert(out.results.len == block_ids.len and out.slots.len == block_ids.len);
        assert(buffer.holder < constants.buffer_holders_max);
        for (block_ids, shard_indices, 0..) |*block_id, shard_index, index| {
            out.slots[index] = slot_none;
            const bucket_index = buffer.bucket_of(block_id);
            buffer.lock_acquire(bucket_index) catch {
                out.results[index] = .lock_timeout;
                continue;
            };
            defer buffer.lock_release(bucket_index);
            if (buffer.find(bucket_index, block_id, shard_index)) |slot_index| {
                const result = buffer.get_resident(slot_index, mode);
                out.results[index] = result;
                // An absent key's idle slot is not the caller's: no slot to release.
                if (result != .absent) out.slots[index] = slot_index;
                continue;
            }
            buffer.count(.misses, 1);
            const namespace = buffer.namespace_of(block_id);
            buffer.namespace_event(namespace + 1, .miss);
            if (mode == .lookup) {
                // No slot for a key nobody will fill: allocating one could evict a Ready block.
                out.results[index] = .absent;
                continue;
            }
            const victim = buffer.allocate_for_get(bucket_index, namespace) orelse {
                buffer.count(.no_slot, 1);
                out.results[index] = .no_slot;
                continue;
            };
            buffer.install(bucket_index, victim.slot, block_id, shard_index, true, namespace);
            out.slots[index] = victim.slot;
            out.results[index] = .owner;
        }
        if (mode == .lookup) {
            // A lookup took no slot to own: nothing was allocated, so nothing was evicted.
            for (out.results, out.slots) |result, slot| {
                assert(result != .owner and result != .no_slot);
                assert((slot == slot_none) == (result == .absent or result == .lock_timeout));
            }
        } else {
            for (out.results) |result| assert(result != .absent);
        }
    }

    fn get_resident(buffer: Buffer, slot_index: u32, mode: GetMode) GetResult {
        const slot = &buffer.slots[slot_index];
        const mine = holder_bit(buffer.holder);
        _ = buffer.drop_dead_refs_locked(slot_index);
        const holders = slot.holders.load(.monotonic);
        if (holders & mine != 0) {
            // Asked again by a process that holds it: a use too, unless it writes.
            if (mode != .write) count_reuse(slot);
            return .held;
        }
        const state: State = @enumFromInt(slot.state.load(.monotonic));
        assert(state != .failed and state != .missing); // Detached by `commit`.
        // Monotonic holder/bit updates: the bucket lock orders them.
        if (state == .ready) {
            _ = slot.holders.fetchOr(mine, .monotonic);
            slot.accessed.store(1, .monotonic);
            if (mode != .write) count_reuse(slot);
            buffer.count(.hits, 1);
            buffer.namespace_event(slot.namespace.load(.monotonic), .hit);
            return .hit;
        }
        buffer.count(.misses, 1);
        buffer.namespace_event(slot.namespace.load(.monotonic), .miss);
        if (holders == 0) {
            // A lookup leaves the idle slot as it is (a Prealloc stays for a load that fills).
            if (mode == .lookup) return .absent;
            // Hit-or-takeover fast path: an idle slot hung by Prealloc (or left by an owner
            // that gave up or died): become its owner without searching for a victim.
            const flags = slot.flags.fetchAnd(slot_flag_reserved, .monotonic);
            if (flags & slot_flag_preallocated != 0) buffer.count(.prealloc_hits, 1);
            slot.owner.store(buffer.holder + 1, .monotonic);
            slot.accessed.store(1, .monotonic);
            _ = slot.holders.fetchOr(mine, .monotonic);
            return .owner;
        }
        _ = slot.holders.fetchOr(mine, .monotonic);
        count_reuse(slot);
        return .waiter;
    }

    /// One more use of the slot's shard (saturating). The caller holds the bucket lock.
    fn count_reuse(slot: *Slot) void {
        // Monotonic: every writer holds the bucket lock, which orders the load and the store.
        const uses = slot.reuses.load(.monotonic);
        if (uses < reuses_max) slot.reuses.store(uses + 1, .monotonic);
    }

    fn allocate_for_get(buffer: Buffer, bucket_index: u32, namespace: u16) ?Victim {
        if (buffer.allocate_once(bucket_index, namespace)) |victim| return victim;
        // Full: slots pinned by processes that died are reclaimable. Look for dead holders
        // (rate limited) and retry once if there are any.
        if (buffer.scan_holders_rate_limited() == 0) return null;
        return buffer.allocate_once(bucket_index, namespace);
    }

    /// Fresh slots, then CLOCK, per pool. A namespace at its cap takes neither fresh slots
    /// nor other namespaces' slots: only its own (else no slot).
    fn allocate_once(buffer: Buffer, bucket_index: u32, namespace: u16) ?Victim {
        const quota = buffer.quota_for(namespace);
        if (quota.grow) {
            if (buffer.take_fresh(.regular, bucket_index)) |slot_index| return .{ .slot = slot_index };
        }
        if (buffer.clock_victim(.regular, bucket_index, false, quota)) |victim| return victim;
        if (quota.grow) {
            if (buffer.take_fresh(.reserved, bucket_index)) |slot_index| return .{ .slot = slot_index };
        }
        return buffer.clock_victim(.reserved, bucket_index, false, quota);
    }

    /// Whether `code` is a valid commit state code: ready, failed or missing, with
    /// `commit_dirty_bit` allowed on ready only.
    pub fn commit_code_valid(code: u8) bool {
        if (code == @intFromEnum(State.ready) | commit_dirty_bit) return true;
        return code >= @intFromEnum(State.ready) and code <= @intFromEnum(State.missing);
    }

    /// Owner publishes the final state: state first, then the version (release), then wake.
    /// A code with `commit_dirty_bit` publishes Ready with write-back debt.
    pub fn commit(buffer: Buffer, slot_indices: []const u32, states: []const u8, out: []CommitResult) void {
        assert(slot_indices.len == states.len and out.len == states.len);
        for (slot_indices, states, out) |slot_index, code, *result| {
            assert(slot_index < buffer.slots.len);
            assert(commit_code_valid(code));
            const dirty = code & commit_dirty_bit != 0;
            const state: State = @enumFromInt(code & ~commit_dirty_bit);
            const slot = &buffer.slots[slot_index];
            if (slot.owner.load(.monotonic) != buffer.holder + 1) {
                result.* = .not_owner;
                continue;
            }
            if (slot.state.load(.monotonic) != @intFromEnum(State.idle)) {
                result.* = .not_idle;
                continue;
            }
            if (state == .failed or state == .missing) {
                buffer.detach_failed(slot_index, state) catch {
                    result.* = .lock_timeout;
                    continue;
                };
            } else {
                if (dirty) {
                    // Before the state: whoever sees the slot Ready sees it dirty, so no
                    // evictor ever takes it clean. The gauge first: whoever clears the flag
                    // (a remove does not hold our reference) decrements after our increment.
                    buffer.count(.dirty_slots, 1);
                    // SeqCst flag, then SeqCst bucket load, against remove_slot's SeqCst
                    // `detached` store, then SeqCst flag clear (Dekker): either the remove
                    // sees our flag and clears it, or we see the slot detached and clear it
                    // ourselves. Debt on a force-removed slot is no flusher's to take.
                    const previous = slot.flags.fetchOr(slot_flag_dirty, .seq_cst);
                    assert(previous & slot_flag_dirty == 0);
                    if (slot.bucket.load(.seq_cst) == bucket_detached) buffer.clear_dirty(slot);
                }
                // Release: the shard bytes written before are visible to whoever acquires it.
                slot.state.store(@intFromEnum(State.ready), .release);
            }
            // Release increment, then the wake, before any bookkeeping: an owner commits with
            // cold caches (it has just slept on I/O), and every cache line touched first would
            // delay each waiter. The waiters count nothing once woken, for the same reason:
            // the kernel tells the owner how many it woke.
            _ = futex.increment(&slot.version);
            const woken = futex.wake_all(&slot.version);
            buffer.count(if (state == .ready) .commits_ready else .commits_failed, 1);
            buffer.count(.wakeups, woken);
            result.* = .ok;
        }
    }

    /// Failures are not remembered: the slot leaves its chain at once (a later Get retries the
    /// key in a fresh slot) and is freed by its last release.
    fn detach_failed(buffer: Buffer, slot_index: u32, state: State) error{LockTimeout}!void {
        assert(state == .failed or state == .missing);
        const slot = &buffer.slots[slot_index];
        assert(slot.holders.load(.monotonic) & holder_bit(buffer.holder) != 0);
        const bucket_index = slot.bucket.load(.acquire);
        if (bucket_index == bucket_detached) {
            slot.state.store(@intFromEnum(state), .release);
            return;
        }
        assert(bucket_index < buffer.buckets.len);
        try buffer.lock_acquire(bucket_index);
        defer buffer.lock_release(bucket_index);
        // Release: pairs with the acquire load of the state in `wait`.
        slot.state.store(@intFromEnum(state), .release);
        if (slot.bucket.load(.monotonic) == bucket_index) {
            buffer.unlink(bucket_index, slot_index);
            buffer.namespace_uncount(slot);
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
        assert(slot.holders.load(.monotonic) & holder_bit(buffer.holder) != 0); // Waiters hold a reference.
        var blocked = false;
        // The owner's liveness costs a /proc read: checked only once a futex slice ran out
        // without a change (or at the deadline), never on the way to blocking.
        var check_owner = false;
        var rounds: u32 = 0;
        while (rounds < constants.buffer_wait_round_max) : (rounds += 1) {
            // Acquire (version, then state): pairs with commit's release store and increment.
            // Reading the version first is what makes a completion between here and the futex
            // call visible: it changes the version, so FUTEX_WAIT returns at once.
            const version = slot.version.load(.acquire);
            const state: State = @enumFromInt(slot.state.load(.acquire));
            switch (state) {
                .idle => {},
                .ready => return .ready,
                .failed => return .failed,
                .missing => return .missing,
            }
            if (debug_wait_pause_ns > 0) std.Thread.sleep(debug_wait_pause_ns);
            const now_ns = futex.monotonic_ns();
            const owner = slot.owner.load(.monotonic);
            // Our own ownership (waiting on a slot we own) simply runs into the timeout.
            if (owner != buffer.holder + 1) {
                const check = check_owner or now_ns >= deadline_ns;
                if (owner == 0 or (check and !buffer.holder_alive(owner - 1))) {
                    switch (buffer.take_over(slot_index, owner)) {
                        .taken => return .takeover,
                        .lost => continue,
                        .lock_timeout => return .lock_timeout,
                    }
                }
            }
            if (now_ns >= deadline_ns) {
                buffer.count(.wait_timeouts, 1);
                return .idle;
            }
            if (!blocked) buffer.count(.waits, 1);
            blocked = true;
            const slice_ns = @min(deadline_ns - now_ns, constants.futex_wait_slice_ns);
            switch (futex.wait(&slot.version, version, slice_ns)) {
                .changed => {}, // Counted by the committer (`wakeups`), off this wake-up path.
                .timed_out => {
                    check_owner = true;
                    buffer.count(.wait_slices, 1);
                },
            }
        }
        return .idle;
    }

    const TakeOver = enum { taken, lost, lock_timeout };

    /// `dead_owner` is the owner word seen (holder + 1, or 0 when nobody owns the slot).
    fn take_over(buffer: Buffer, slot_index: u32, dead_owner: u32) TakeOver {
        const slot = &buffer.slots[slot_index];
        assert(dead_owner != buffer.holder + 1);
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
        if (slot.owner.cmpxchgStrong(dead_owner, buffer.holder + 1, .monotonic, .monotonic) != null) {
            return .lost;
        }
        // The dead owner held one reference (taken by its Get); drop it on its behalf (unless
        // a dead-holder sweep already did). Ours stays.
        if (dead_owner != 0) {
            const previous = slot.holders.fetchAnd(~holder_bit(dead_owner - 1), .monotonic);
            if (previous & holder_bit(dead_owner - 1) != 0) buffer.count(.refs_reclaimed, 1);
        }
        assert(slot.holders.load(.monotonic) & holder_bit(buffer.holder) != 0);
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
            const mine = holder_bit(buffer.holder);
            if (bucket_index == bucket_detached) {
                // The owner gives up without committing, as on a chain below: waiters on this
                // force-removed slot take over instead of waiting on an owner that left. Found
                // by the fuzzer. Before our bit goes, so the slot cannot be freed and reused
                // under us; CAS, since a waiter may take the slot over at the same time.
                if (slot.state.load(.monotonic) == @intFromEnum(State.idle)) {
                    _ = slot.owner.cmpxchgStrong(buffer.holder + 1, 0, .monotonic, .monotonic);
                }
                // AcqRel: the last releaser must see every other holder's accesses.
                const previous = slot.holders.fetchAnd(~mine, .acq_rel);
                if (previous & mine == 0) return false; // listed twice in one batch
                if (previous == mine) buffer.free_slot(slot_index);
                return true;
            }
            assert(bucket_index < buffer.buckets.len);
            buffer.lock_acquire(bucket_index) catch return false;
            defer buffer.lock_release(bucket_index);
            // Only a detach can move a referenced slot; retry on the detached path.
            if (slot.bucket.load(.monotonic) != bucket_index) continue;
            if (slot.holders.load(.monotonic) & mine == 0) return false; // listed twice
            const idle = slot.state.load(.monotonic) == @intFromEnum(State.idle);
            if (idle and slot.owner.load(.monotonic) == buffer.holder + 1) {
                // The owner gives up without committing: waiters may take over.
                slot.owner.store(0, .monotonic);
            }
            _ = slot.holders.fetchAnd(~mine, .monotonic);
            return true;
        }
        unreachable; // A slot is detached at most once while referenced.
    }

    // ---------------------------------------------------------------------------------------
    // Write-back debt: flushers take dirty slots, write them to the `write: back` tiers below
    // (in Python: the tiers are plugins) and clean them.

    pub const DirtyOutput = struct {
        slots: []u32,
        block_ids: []BlockId,
        shard_indices: []u32,
    };

    /// Claims up to `out.slots.len` dirty Ready slots for writing down, scanning at most every
    /// slot once from `cursor.*` (a position the caller keeps between calls; it moves past the
    /// last slot scanned). Each claimed slot gets this holder's reference (its bytes stay put
    /// while it is written down) and this holder as its flusher, so concurrent flushers in
    /// other processes or threads partition the debt. A slot this holder already references,
    /// or that a live flusher writes, is skipped. Returns how many were claimed.
    pub fn take_dirty(buffer: Buffer, cursor: *u32, out: DirtyOutput) u32 {
        assert(out.slots.len == out.block_ids.len and out.slots.len == out.shard_indices.len);
        assert(buffer.holder < constants.buffer_holders_max);
        const total: u32 = @intCast(buffer.slots.len);
        const mine = holder_bit(buffer.holder);
        var taken: u32 = 0;
        var scanned: u32 = 0;
        var position = cursor.* % total;
        while (scanned < total and taken < out.slots.len) : (scanned += 1) {
            const slot_index = position;
            position = (position + 1) % total;
            const slot = &buffer.slots[slot_index];
            // Unlocked pre-checks (monotonic: hints, re-checked under the lock).
            if (slot.flags.load(.monotonic) & slot_flag_dirty == 0) continue;
            const flusher_seen = slot.flusher.load(.monotonic);
            // A live flusher's liveness is read outside the lock (it may read /proc).
            if (flusher_seen != 0 and (flusher_seen == buffer.holder + 1 or buffer.holder_alive(flusher_seen - 1))) continue;
            const bucket_index = slot.bucket.load(.acquire);
            if (bucket_index >= buffer.buckets.len) continue; // Free or detached: no debt to take.
            buffer.lock_acquire(bucket_index) catch continue;
            defer buffer.lock_release(bucket_index);
            if (slot.bucket.load(.monotonic) != bucket_index) continue;
            if (slot.flags.load(.monotonic) & slot_flag_dirty == 0) continue;
            if (slot.state.load(.monotonic) != @intFromEnum(State.ready)) continue;
            if (slot.holders.load(.monotonic) & mine != 0) continue;
            if (slot.flusher.load(.monotonic) != flusher_seen) continue;
            slot.flusher.store(buffer.holder + 1, .monotonic);
            _ = slot.holders.fetchOr(mine, .monotonic);
            out.slots[taken] = slot_index;
            out.block_ids[taken] = slot.block_id;
            out.shard_indices[taken] = slot.shard_index;
            taken += 1;
        }
        cursor.* = position;
        assert(taken <= out.slots.len);
        return taken;
    }

    /// What `admit` checks for one lower tier (its admission index `tier`).
    pub const AdmitRule = struct {
        /// Uses the shard needs (`Slot.reuses`); 0 admits on residency alone.
        reuses_min: u16,
        tier: u32,
        /// This call is the tier's residency check (the shard survived its minimum
        /// residency): mark the slot matured for the tier before checking.
        mature: bool,
        /// The tier has a minimum residency: only a matured slot is admitted.
        needs_mature: bool,
    };

    /// Admission: per key, when the slot is Ready and meets `rule` and was not yet admitted to
    /// the tier, sets its admitted bit and takes this holder's reference (so it cannot be
    /// evicted while the caller writes it down; released like `take_dirty`'s), and writes the
    /// slot to `out_slots[i]`, else `slot_none`. The bit makes exactly one process node-wide
    /// the writer. A slot this holder already references is skipped (checked again at the
    /// key's next use). `admit` never counts a use. Returns how many were admitted.
    pub fn admit(buffer: Buffer, block_ids: []const BlockId, shard_indices: []const u32, rule: AdmitRule, out_slots: []u32) u32 {
        assert(block_ids.len == shard_indices.len and out_slots.len == block_ids.len);
        assert(rule.tier < admission_tiers_max);
        assert(buffer.holder < constants.buffer_holders_max);
        const admitted_bit = @as(u32, 1) << (slot_flag_admitted_shift + @as(u5, @intCast(rule.tier)));
        const matured_bit = @as(u32, 1) << (slot_flag_matured_shift + @as(u5, @intCast(rule.tier)));
        const mine = holder_bit(buffer.holder);
        var admitted: u32 = 0;
        for (block_ids, shard_indices, out_slots) |*block_id, shard_index, *out| {
            out.* = slot_none;
            const bucket_index = buffer.bucket_of(block_id);
            buffer.lock_acquire(bucket_index) catch continue; // Not admitted now; next use.
            defer buffer.lock_release(bucket_index);
            const slot_index = buffer.find(bucket_index, block_id, shard_index) orelse continue;
            const slot = &buffer.slots[slot_index];
            if (slot.state.load(.monotonic) != @intFromEnum(State.ready)) continue;
            // Monotonic flag and holder updates: the bucket lock orders them.
            if (rule.mature) _ = slot.flags.fetchOr(matured_bit, .monotonic);
            const flags = slot.flags.load(.monotonic);
            if (rule.needs_mature and flags & matured_bit == 0) continue;
            if (flags & admitted_bit != 0) continue;
            if (slot.reuses.load(.monotonic) < rule.reuses_min) continue;
            if (slot.holders.load(.monotonic) & mine != 0) continue;
            _ = slot.flags.fetchOr(admitted_bit, .monotonic);
            _ = slot.holders.fetchOr(mine, .monotonic);
            out.* = slot_index;
            admitted += 1;
        }
        assert(admitted <= block_ids.len);
        return admitted;
    }

    /// Undoes `admit` for slots this holder still references from it: clears their admitted bit
    /// for lower tier `tier`, so that the key's next check admits it again. For a write to the
    /// tier that failed: with the bit left set, no process of the node would ever write the
    /// shard there (admission is exactly once per residency). No bucket lock: every change of
    /// `flags` is an atomic read-modify-write, and the slot, referenced, is neither freed nor
    /// reinstalled meanwhile (a concurrent `admit` of the key in another process sees the bit
    /// set, and skips, or cleared, and admits it then). Returns how many bits were cleared.
    pub fn unadmit(buffer: Buffer, slot_indices: []const u32, tier: u32) u32 {
        assert(tier < admission_tiers_max);
        const admitted_bit = @as(u32, 1) << (slot_flag_admitted_shift + @as(u5, @intCast(tier)));
        var cleared: u32 = 0;
        for (slot_indices) |slot_index| {
            assert(slot_index < buffer.slots.len);
            const previous = buffer.slots[slot_index].flags.fetchAnd(~admitted_bit, .monotonic);
            cleared += @intFromBool(previous & admitted_bit != 0);
        }
        assert(cleared <= slot_indices.len);
        return cleared;
    }

    /// Per key, `Slot.reuses` of its resident slot (Ready or being filled), 0 when absent.
    pub fn reuses(buffer: Buffer, block_ids: []const BlockId, shard_indices: []const u32, out: []u16) error{LockTimeout}!void {
        assert(block_ids.len == shard_indices.len and out.len == block_ids.len);
        for (block_ids, shard_indices, out) |*block_id, shard_index, *count_out| {
            const bucket_index = buffer.bucket_of(block_id);
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            count_out.* = 0;
            if (buffer.find(bucket_index, block_id, shard_index)) |slot_index| {
                // Monotonic: written only under this bucket lock, which we hold.
                count_out.* = buffer.slots[slot_index].reuses.load(.monotonic);
            }
        }
    }

    /// Ends the flush of slots claimed by `take_dirty`: where `written[i]` is set the debt is
    /// paid (the dirty flag cleared), else the slot stays dirty for a later flush. The caller
    /// still holds the reference `take_dirty` took and releases it after (its process may
    /// share that reference between threads). Returns how many were cleaned.
    pub fn clean(buffer: Buffer, slot_indices: []const u32, written: []const u8) u32 {
        assert(slot_indices.len == written.len);
        var cleaned: u32 = 0;
        for (slot_indices, written) |slot_index, ok| {
            assert(slot_index < buffer.slots.len);
            const slot = &buffer.slots[slot_index];
            const bucket_index = slot.bucket.load(.acquire);
            if (bucket_index < buffer.buckets.len) locked: {
                buffer.lock_acquire(bucket_index) catch break :locked;
                defer buffer.lock_release(bucket_index);
                // Only a detach moves a referenced slot; a detached one owes nothing.
                if (slot.bucket.load(.monotonic) != bucket_index) break :locked;
                if (slot.flusher.load(.monotonic) != buffer.holder + 1) break :locked;
                slot.flusher.store(0, .monotonic);
                if (ok != 0 and slot.flags.load(.monotonic) & slot_flag_dirty != 0) {
                    buffer.clear_dirty(slot);
                    buffer.count(.flushed, 1);
                    cleaned += 1;
                }
            }
        }
        return cleaned;
    }

    /// Marks this holder closing (or open again) and tells whether it is the last: no other
    /// registered holder is live and not closing. The last one to close pays every debt.
    /// Sequentially consistent store then loads (Dekker): of two holders closing at once, at
    /// least one sees the other closing, so the debt is never left for nobody.
    pub fn mark_closing(buffer: Buffer, closing: bool) bool {
        assert(buffer.holder < constants.buffer_holders_max);
        const entries = &buffer.holder_table.entries;
        entries[buffer.holder].closing.store(@intFromBool(closing), .seq_cst);
        if (!closing) return false;
        for (entries, 0..) |*entry, index| {
            if (index == buffer.holder) continue;
            if (entry.state() != .live) continue;
            if (entry.closing.load(.seq_cst) != 0) continue;
            if (buffer.holder_alive(@intCast(index))) return false;
        }
        return true;
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
            // Speculation never grows a namespace past its cap: at it, only one of its own
            // unused prewarms is recycled.
            const namespace = buffer.namespace_of(block_id);
            const quota = buffer.quota_for(namespace);
            const fresh = if (quota.grow)
                buffer.take_fresh(.regular, bucket_index) orelse buffer.take_fresh(.reserved, bucket_index)
            else
                null;
            const slot_index = fresh orelse
                if (buffer.clock_victim(.reserved, bucket_index, true, quota)) |victim| victim.slot else null;
            if (slot_index) |index| {
                buffer.install(bucket_index, index, block_id, shard_index, false, namespace);
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

    pub const KeyOutput = struct {
        block_ids: []BlockId,
        shard_indices: []u32,
    };

    /// Lists the keys of up to `out.block_ids.len` Ready slots, scanning at most every slot
    /// once from `cursor.*` (a position the caller keeps between calls; it moves past the last
    /// slot scanned, and wraps to 0 after the last slot). Read-only: no reference is taken, so
    /// a listed key may be evicted or removed right after; each key is read under its bucket
    /// lock, so it is never torn. What namespaces enumerate (purge, per-namespace occupancy).
    pub fn list_ready(buffer: Buffer, cursor: *u32, out: KeyOutput) error{LockTimeout}!u32 {
        assert(out.block_ids.len == out.shard_indices.len);
        const total: u32 = @intCast(buffer.slots.len);
        assert(total > 0);
        var listed: u32 = 0;
        var position = cursor.*;
        while (position < total and listed < out.block_ids.len) : (position += 1) {
            const slot = &buffer.slots[position];
            // Unlocked pre-check (monotonic: a hint, re-checked under the lock).
            if (slot.state.load(.monotonic) != @intFromEnum(State.ready)) continue;
            const bucket_index = slot.bucket.load(.acquire);
            if (bucket_index >= buffer.buckets.len) continue; // Free or detached: not listed.
            try buffer.lock_acquire(bucket_index);
            defer buffer.lock_release(bucket_index);
            if (slot.bucket.load(.monotonic) != bucket_index) continue;
            if (slot.state.load(.monotonic) != @intFromEnum(State.ready)) continue;
            out.block_ids[listed] = slot.block_id;
            out.shard_indices[listed] = slot.shard_index;
            listed += 1;
        }
        cursor.* = if (position >= total) 0 else position;
        assert(listed <= out.block_ids.len);
        return listed;
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
            buffer.count(.remove_lock_acquisitions, 1);
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
        // A pin left by a dead process does not keep the shard.
        if (buffer.drop_dead_refs_locked(slot_index)) {
            buffer.unlink(bucket_index, slot_index);
            buffer.free_slot(slot_index);
        } else if (force) {
            buffer.unlink(bucket_index, slot_index);
            buffer.namespace_uncount(slot);
            // SeqCst (includes the release that pairs with the acquire load in `release_one`):
            // detached first, then the debt cleared, against a racing dirty commit (see
            // `commit`).
            slot.bucket.store(bucket_detached, .seq_cst);
            // Removed on purpose: not debt any more (its flusher, if any, cleans nothing).
            buffer.clear_dirty(slot);
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

    pub fn debug_hold_registration_lock(buffer: Buffer) error{LockTimeout}!void {
        try buffer.registration_lock_acquire();
    }
};

// -------------------------------------------------------------------------------------------
// Namespace quotas: deterministic scenarios (the fuzzer checks them under random operations).

const quota_test_geometry = Geometry{
    .shard_size_bytes = 64,
    .slot_count_regular = 8,
    .slot_count_reserved = 0,
    .bucket_count = 4,
    .slots_per_segment = 8,
};
var quota_test_memory: [8192 + constants.buffer_namespace_names_size_bytes + constants.buffer_control_table_size_bytes + constants.removal_log_size_bytes]u8 align(constants.buffer_cache_line_bytes) = undefined;

fn quota_test_buffer() !Buffer {
    assert(ctrl_size_bytes(quota_test_geometry) <= quota_test_memory.len);
    const base = @intFromPtr(&quota_test_memory);
    try std.testing.expectEqual(Status.ok, Buffer.init(base, quota_test_memory.len, quota_test_geometry, 0));
    var buffer = Buffer.open(base).?;
    buffer.holder = try buffer.register();
    return buffer;
}

fn quota_test_id(tag: u64, block: u32) BlockId {
    var id: BlockId = @splat(0);
    std.mem.writeInt(u64, id[0..8], tag, .little);
    std.mem.writeInt(u32, id[8..12], block, .little);
    return id;
}

/// Gets, commits Ready and releases one block of `tag`; returns the Get's result.
fn quota_test_insert(buffer: Buffer, tag: u64, block: u32) GetResult {
    const ids = [_]BlockId{quota_test_id(tag, block)};
    var results: [1]GetResult = undefined;
    var slots: [1]u32 = undefined;
    buffer.get(&ids, &.{0}, .{ .results = &results, .slots = &slots });
    if (results[0] == .owner) {
        var committed: [1]CommitResult = undefined;
        buffer.commit(&slots, &.{@intFromEnum(State.ready)}, &committed);
        assert(committed[0] == .ok);
    }
    if (slots[0] != slot_none) _ = buffer.release(&slots);
    return results[0];
}

test "namespaces: register, re-register, and the named errors" {
    const buffer = try quota_test_buffer();
    try std.testing.expectEqual(@as(u16, 0), try buffer.register_namespace(0, 2, 8));
    try std.testing.expectEqual(@as(u16, 1), try buffer.register_namespace(0xA, 4, 6));
    try std.testing.expectEqual(@as(u16, 1), try buffer.register_namespace(0xA, 3, 6)); // update
    try std.testing.expectEqual(@as(u32, 3), buffer.namespace_table.entries[1].guarantee_slots.load(.monotonic));
    try std.testing.expectError(error.InvalidArgument, buffer.register_namespace(0xB, 5, 4));
    try std.testing.expectError(error.InvalidArgument, buffer.register_namespace(0xB, 0, 9));
    // 2 (default) + 3 (A) + 4 > 8 regular slots.
    try std.testing.expectError(error.GuaranteesOver, buffer.register_namespace(0xB, 4, 8));
    var tag: u64 = 0x100;
    while (tag < 0x100 + constants.buffer_namespaces_max - 2) : (tag += 1) {
        _ = try buffer.register_namespace(tag, 0, 8);
    }
    try std.testing.expectError(error.NamespacesFull, buffer.register_namespace(0xC, 0, 8));
    try std.testing.expectEqual(@as(u16, 1), buffer.namespace_of(&quota_test_id(0xA, 7)));
    try std.testing.expectEqual(@as(u16, 0), buffer.namespace_of(&quota_test_id(0xD, 7)));
}

test "control records: a monotonic maximum per name, outside every slot; a full table is an error" {
    const buffer = try quota_test_buffer();
    const a: Buffer.ControlName = @splat(0xA);
    const b: Buffer.ControlName = @splat(0xB);
    try std.testing.expectEqual(@as(?u64, null), buffer.control_read(&a));
    try std.testing.expectEqual(@as(u64, 3), try buffer.control_raise(&a, 3));
    try std.testing.expectEqual(@as(u64, 3), try buffer.control_raise(&a, 1)); // never lowered
    try std.testing.expectEqual(@as(u64, 7), try buffer.control_raise(&a, 7));
    try std.testing.expectEqual(@as(?u64, 7), buffer.control_read(&a));
    try std.testing.expectEqual(@as(?u64, null), buffer.control_read(&b));
    // A record is no slot: no key, no occupancy, nothing for eviction or remove to take.
    try std.testing.expectEqual(@as(u32, 0), buffer.namespace_table.entries[0].occupancy_slots.load(.monotonic));
    // Two entries of one name (a registration race) read as their maximum.
    var twin = &buffer.control_table.entries[constants.buffer_controls_max - 1];
    twin.name = a;
    twin.value.store(9, .monotonic);
    twin.state.store(@intFromEnum(NamespaceState.live), .release);
    try std.testing.expectEqual(@as(?u64, 9), buffer.control_read(&a));
    try std.testing.expectEqual(@as(u64, 9), try buffer.control_raise(&a, 8));
    var index: u32 = 1;
    while (index < constants.buffer_controls_max - 1) : (index += 1) {
        var name: Buffer.ControlName = @splat(0);
        std.mem.writeInt(u32, name[0..4], index, .little);
        _ = try buffer.control_raise(&name, index);
    }
    try std.testing.expectError(error.ControlsFull, buffer.control_raise(&b, 1));
    try std.testing.expectEqual(@as(u64, 10), try buffer.control_raise(&a, 10)); // still raised
}

test "namespaces: a flood from B never pushes A below its guarantee; A at its cap evicts its own" {
    const buffer = try quota_test_buffer();
    const a = try buffer.register_namespace(0xA, 3, 4);
    const b = try buffer.register_namespace(0xB, 0, 8);
    for (0..4) |block| try std.testing.expectEqual(GetResult.owner, quota_test_insert(buffer, 0xA, @intCast(block)));
    try std.testing.expectEqual(@as(u32, 4), buffer.namespace_occupancy(a));
    // A at its cap (4): its fifth block evicts one of its own, never a free slot.
    try std.testing.expectEqual(GetResult.owner, quota_test_insert(buffer, 0xA, 4));
    try std.testing.expectEqual(@as(u32, 4), buffer.namespace_occupancy(a));
    try std.testing.expectEqual(@as(u32, 4), buffer.clock.fresh_regular.load(.monotonic));
    // B floods: 100 blocks through the 8 slots. A keeps exactly its guarantee.
    for (0..100) |block| try std.testing.expectEqual(GetResult.owner, quota_test_insert(buffer, 0xB, @intCast(block)));
    try std.testing.expectEqual(@as(u32, 3), buffer.namespace_occupancy(a));
    try std.testing.expectEqual(@as(u32, 5), buffer.namespace_occupancy(b));
    // The counters are exact: a recount from the chains finds the same.
    try buffer.recount_namespaces();
    try std.testing.expectEqual(@as(u32, 3), buffer.namespace_occupancy(a));
    try std.testing.expectEqual(@as(u32, 5), buffer.namespace_occupancy(b));
    // A remove uncounts; a recount repairs a drifted counter.
    try std.testing.expectEqual(@as(u64, 1), try buffer.remove(&.{quota_test_id(0xB, 99)}, null, false));
    try std.testing.expectEqual(@as(u32, 4), buffer.namespace_occupancy(b));
    buffer.namespace_table.entries[b].occupancy_slots.store(7, .monotonic);
    try buffer.recount_namespaces();
    try std.testing.expectEqual(@as(u32, 4), buffer.namespace_occupancy(b));
}

test "get: a lookup never allocates, evicts or takes an idle slot over; a claim does" {
    const buffer = try quota_test_buffer();
    const expectEqual = std.testing.expectEqual;
    // An idle slot nobody holds (Prealloc's), then seven Ready blocks: every slot is taken.
    const prewarmed = [_]BlockId{quota_test_id(0, 50)};
    var prealloc_result: [1]PreallocResult = undefined;
    buffer.prealloc(&prewarmed, &.{0}, &prealloc_result);
    try expectEqual(PreallocResult.allocated, prealloc_result[0]);
    for (0..7) |block| try expectEqual(GetResult.owner, quota_test_insert(buffer, 0, @intCast(block)));
    try expectEqual(@as(u64, 0), buffer.occupancy().free);
    const evictions = buffer.counter_value(.evictions);
    const occupancy = buffer.occupancy();
    // A lookup: absent for a key with no slot and for the idle prewarm, a hit for a Ready one.
    const ids = [_]BlockId{ quota_test_id(0, 100), prewarmed[0], quota_test_id(0, 3) };
    var results: [3]GetResult = undefined;
    var slots: [3]u32 = undefined;
    buffer.get_as(.lookup, &ids, &.{ 0, 0, 0 }, .{ .results = &results, .slots = &slots });
    try std.testing.expectEqualSlices(GetResult, &.{ .absent, .absent, .hit }, &results);
    try std.testing.expectEqualSlices(u32, &.{ slot_none, slot_none }, slots[0..2]);
    try expectEqual(@as(u32, 1), buffer.release(slots[2..3]));
    try expectEqual(evictions, buffer.counter_value(.evictions));
    try std.testing.expectEqualDeep(occupancy, buffer.occupancy());
    var present: [7]u8 = undefined;
    var kept: [7]BlockId = undefined;
    for (&kept, 0..) |*id, block| id.* = quota_test_id(0, @intCast(block));
    try buffer.lookup(&kept, &(.{0} ** 7), &present);
    try std.testing.expectEqualSlices(u8, &(.{1} ** 7), &present);
    const slot = (try buffer.find_locked(&prewarmed[0], 0)).?;
    try std.testing.expect(buffer.slots[slot].flags.load(.monotonic) & slot_flag_preallocated != 0);
    try expectEqual(@as(u32, 0), buffer.slots[slot].refcount());
    // A claim of the same keys: the prewarm is taken over, the absent key evicts a Ready block.
    const claimed = [_]BlockId{ prewarmed[0], ids[0] };
    buffer.get(&claimed, &.{ 0, 0 }, .{ .results = results[0..2], .slots = slots[0..2] });
    try std.testing.expectEqualSlices(GetResult, &.{ .owner, .owner }, results[0..2]);
    try expectEqual(slot, slots[0]);
    try expectEqual(@as(u64, 1), buffer.counter_value(.prealloc_hits));
    try expectEqual(evictions + 1, buffer.counter_value(.evictions));
    _ = buffer.release(slots[0..2]);
}

test "namespace names: one entry per tag, idempotent, conflicts and a full table are errors" {
    const buffer = try quota_test_buffer();
    try std.testing.expectEqual(@as(?u32, null), buffer.namespace_name_find(0xA));
    const index = try buffer.register_namespace_name(0xA, "tenant-a");
    try std.testing.expectEqual(index, try buffer.register_namespace_name(0xA, "tenant-a"));
    try std.testing.expectEqual(@as(?u32, index), buffer.namespace_name_find(0xA));
    try std.testing.expectError(error.NameConflict, buffer.register_namespace_name(0xA, "tenant-b"));
    try std.testing.expectError(error.InvalidArgument, buffer.register_namespace_name(0, "x"));
    try std.testing.expectError(error.InvalidArgument, buffer.register_namespace_name(0xB, ""));
    var copy: NamespaceName = undefined;
    buffer.namespace_name_copy(index, &copy);
    try std.testing.expectEqual(@as(u32, 8), copy.name_len_bytes.load(.monotonic));
    try std.testing.expectEqual(name_to_words("tenant-a"), blk: {
        var words: [name_words]u64 = undefined;
        for (&words, &copy.name) |*word, *value| word.* = value.load(.monotonic);
        break :blk words;
    });
    // Tags colliding modulo the table probe on; a registrant killed before publishing its
    // name leaves the tag claimed with length 0: invisible, completed by the next registrant.
    const colliding: u64 = 0xA + constants.buffer_namespace_names_max;
    const next = try buffer.register_namespace_name(colliding, "other");
    try std.testing.expect(next != index);
    buffer.namespace_names.entries[next].name_len_bytes.store(0, .monotonic);
    try std.testing.expectEqual(@as(?u32, null), buffer.namespace_name_find(colliding));
    try std.testing.expectEqual(next, try buffer.register_namespace_name(colliding, "other"));
    var tag: u64 = 1 << 32; // distinct from the tags above modulo 2^64, alike modulo the table
    while (buffer.namespace_names.used.load(.monotonic) < constants.buffer_namespace_names_max) : (tag += 1) {
        _ = try buffer.register_namespace_name(tag, "n");
    }
    try std.testing.expectError(error.NamesFull, buffer.register_namespace_name(tag, "n"));
    try std.testing.expectEqual(@as(?u32, index), buffer.namespace_name_find(0xA));
    try std.testing.expectEqual(@as(?u32, null), buffer.namespace_name_find(tag));
}

test "namespaces: threads registering at once take one entry per tag and never over-guarantee" {
    const buffer = try quota_test_buffer();
    const threads_count = 4;
    const Racer = struct {
        fn run(view: Buffer, start: *Atomic(u32), seed: u64) void {
            while (start.load(.acquire) == 0) std.atomic.spinLoopHint();
            // Every thread asks for the same two tags; each guarantee alone fits, both do not.
            const first: u64 = if (seed % 2 == 0) 0xA else 0xB;
            const second: u64 = if (first == 0xA) 0xB else 0xA;
            _ = view.register_namespace(first, quota_test_geometry.slot_count_regular, quota_test_geometry.slot_count_regular) catch {};
            _ = view.register_namespace(second, quota_test_geometry.slot_count_regular, quota_test_geometry.slot_count_regular) catch {};
            _ = view.register_namespace_name(0xA, "racer") catch {};
        }
    };
    var start = Atomic(u32).init(0);
    var threads: [threads_count]std.Thread = undefined;
    for (&threads, 0..) |*thread, index| thread.* = try std.Thread.spawn(.{}, Racer.run, .{ buffer, &start, index });
    start.store(1, .release);
    for (threads) |thread| thread.join();
    var live: u32 = 0;
    var guaranteed: u64 = 0;
    for (buffer.namespace_table.entries[1..]) |*entry| {
        if (entry.state.load(.acquire) != @intFromEnum(NamespaceState.live)) continue;
        live += 1;
        guaranteed += entry.guarantee_slots.load(.monotonic);
    }
    try std.testing.expectEqual(@as(u32, 1), live);
    try std.testing.expect(guaranteed <= quota_test_geometry.slot_count_regular);
    try std.testing.expectEqual(@as(u32, 1), buffer.namespace_names.used.load(.monotonic));
}
