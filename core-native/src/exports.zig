//! The one C-ABI surface of libucm_core. Every exported symbol is prefixed `ucm_`, takes plain
//! integers and pointers, and never panics on caller input: bad input returns a negative code.
const std = @import("std");
const constants = @import("constants.zig");
const futex = @import("futex.zig");

pub const Error = enum(i32) {
    ok = 0,
    invalid_argument = -1,
};

pub export fn ucm_abi_version() u32 {
    return constants.abi_version;
}

/// Blocks while the 32-bit word at `word_addr` equals `expected`, up to `timeout_ns`.
/// Returns 0 when the word changed, 1 on timeout, a negative error on a bad address.
pub export fn ucm_version_wait(word_addr: usize, expected: u32, timeout_ns: u64) i32 {
    if (word_addr == 0 or word_addr % constants.futex_word_size_bytes != 0) {
        return @intFromEnum(Error.invalid_argument);
    }
    const word: *const std.atomic.Value(u32) = @ptrFromInt(word_addr);
    return @intFromEnum(futex.wait(word, expected, timeout_ns));
}

/// Increments the word at `word_addr` and wakes every waiter. Returns the new version as a
/// non-negative i64, or a negative error on a bad address.
pub export fn ucm_version_bump(word_addr: usize) i64 {
    if (word_addr == 0 or word_addr % constants.futex_word_size_bytes != 0) {
        return @intFromEnum(Error.invalid_argument);
    }
    const word: *std.atomic.Value(u32) = @ptrFromInt(word_addr);
    return futex.bump(word);
}

/// Reads the word at `word_addr` with acquire ordering.
pub export fn ucm_version_load(word_addr: usize) i64 {
    if (word_addr == 0 or word_addr % constants.futex_word_size_bytes != 0) {
        return @intFromEnum(Error.invalid_argument);
    }
    const word: *const std.atomic.Value(u32) = @ptrFromInt(word_addr);
    return futex.load(word);
}

pub export fn ucm_monotonic_ns() u64 {
    return futex.monotonic_ns();
}

// ---- Checksums ----

const checksum = @import("checksum.zig");

/// XXH3-64 with `seed` over `n` caller ranges (`lengths_bytes[i]` bytes at `addresses[i]`),
/// streamed in order, written to `out`. Returns 0, or invalid_argument for too many ranges or
/// a null address with a non-zero length.
pub export fn ucm_checksum(n: u32, addresses: [*]const usize, lengths_bytes: [*]const usize, seed: u64, out: *u64) i32 {
    if (n > constants.checksum_parts_max) return @intFromEnum(Error.invalid_argument);
    for (addresses[0..n], lengths_bytes[0..n]) |address, length_bytes| {
        if (address == 0 and length_bytes != 0) return @intFromEnum(Error.invalid_argument);
    }
    out.* = checksum.checksum_ranges(seed, addresses[0..n], lengths_bytes[0..n]);
    return @intFromEnum(Error.ok);
}

// ---- Copies ----

/// Copies `n` caller ranges, `lengths_bytes[i]` bytes from `sources[i]` to `destinations[i]`,
/// in order, in one call: a Python caller releases the GIL once for all of them, where one
/// `ctypes.memmove` per range waits to take the GIL back after every range (behind any other
/// Python thread that runs, up to a switch interval each). Stores are fenced before it
/// returns. Returns 0, or invalid_argument (nothing copied) for more than `copy_ranges_max`
/// ranges, a null address with a non-zero length, a range that wraps the address space, or
/// a range whose source and destination overlap.
pub export fn ucm_copy_ranges(n: u32, destinations: [*]const usize, sources: [*]const usize, lengths_bytes: [*]const usize) i32 {
    if (n > constants.copy_ranges_max) return @intFromEnum(Error.invalid_argument);
    if (!copy_ranges_valid(destinations[0..n], sources[0..n], lengths_bytes[0..n])) {
        return @intFromEnum(Error.invalid_argument);
    }
    for (destinations[0..n], sources[0..n], lengths_bytes[0..n]) |destination, source, length_bytes| {
        queue_module.copy_bytes(destination, source, length_bytes);
    }
    queue_module.store_fence(); // the non-temporal stores of copy_bytes, before the caller reads
    return @intFromEnum(Error.ok);
}

fn copy_ranges_valid(destinations: []const usize, sources: []const usize, lengths_bytes: []const usize) bool {
    std.debug.assert(destinations.len == sources.len and sources.len == lengths_bytes.len);
    for (destinations, sources, lengths_bytes) |destination, source, length_bytes| {
        if (length_bytes == 0) continue;
        if (destination == 0 or source == 0) return false;
        const destination_end = std.math.add(usize, destination, length_bytes) catch return false;
        const source_end = std.math.add(usize, source, length_bytes) catch return false;
        if (destination < source_end and source < destination_end) return false; // overlap
    }
    return true;
}

test "copy_ranges: copies every range byte for byte and refuses bad ranges whole" {
    var prng = std.Random.DefaultPrng.init(11);
    const random = prng.random();
    var source: [4096 + 64]u8 = undefined;
    random.bytes(&source);
    var target = [_]u8{0} ** (4096 + 64);
    // Three ranges, one long enough for the non-temporal path, one empty, one unaligned.
    const destinations = [_]usize{ @intFromPtr(&target) + 1, @intFromPtr(&target), @intFromPtr(&target) + 4097 };
    const sources = [_]usize{ @intFromPtr(&source) + 3, 0, @intFromPtr(&source) };
    const lengths_bytes = [_]usize{ 4096, 0, 63 };
    try std.testing.expectEqual(@as(i32, 0), ucm_copy_ranges(3, &destinations, &sources, &lengths_bytes));
    try std.testing.expectEqualSlices(u8, source[3 .. 3 + 4096], target[1 .. 1 + 4096]);
    try std.testing.expectEqualSlices(u8, source[0..63], target[4097 .. 4097 + 63]);
    try std.testing.expectEqual(@as(u8, 0), target[0]);

    const before = target;
    const invalid = @intFromEnum(Error.invalid_argument);
    // The second range overlaps itself: nothing is copied, not even the first range.
    const first_then_overlap_destinations = [_]usize{ @intFromPtr(&target) + 100, @intFromPtr(&target) };
    const first_then_overlap_sources = [_]usize{ @intFromPtr(&source), @intFromPtr(&target) + 10 };
    const first_then_overlap_lengths = [_]usize{ 8, 11 };
    try std.testing.expectEqual(invalid, ucm_copy_ranges(
        2,
        &first_then_overlap_destinations,
        &first_then_overlap_sources,
        &first_then_overlap_lengths,
    ));
    const nulls = [_]usize{0};
    const one = [_]usize{1};
    try std.testing.expectEqual(invalid, ucm_copy_ranges(1, &nulls, &sources, &one));
    const wrapping = [_]usize{std.math.maxInt(usize) - 2};
    const four = [_]usize{4};
    try std.testing.expectEqual(invalid, ucm_copy_ranges(1, &wrapping, &sources, &four));
    const too_many: u32 = @intCast(constants.copy_ranges_max + 1);
    try std.testing.expectEqual(invalid, ucm_copy_ranges(too_many, &destinations, &sources, &lengths_bytes));
    try std.testing.expectEqualSlices(u8, &before, &target);
}

// ---- CacheBuffer ----
// Batched entry points over a control region at `ctrl` (see buffer.zig). Arrays are caller
// memory of `n` elements; per-key outcomes are written to `out_*`. A negative return is a
// buffer.Status: the region is not an initialised CacheBuffer or an argument is out of range.

const buffer = @import("buffer.zig");

fn buffer_open(ctrl: usize) ?buffer.Buffer {
    return buffer.Buffer.open(ctrl);
}

/// A view acting as holder `holder`, which must be registered to the calling process.
fn buffer_open_holder(ctrl: usize, holder: u32) union(enum) { view: buffer.Buffer, status: i32 } {
    var view = buffer_open(ctrl) orelse return .{ .status = buffer_status(.bad_magic) };
    if (!view.holder_valid(holder)) return .{ .status = buffer_status(.not_registered) };
    view.holder = holder;
    return .{ .view = view };
}

/// Every slot must carry this holder's reference (wait, release).
fn buffer_slots_held(view: buffer.Buffer, slots: []const u32) bool {
    const mine = buffer.holder_bit(view.holder);
    for (slots) |slot| {
        if (slot >= view.slots.len) return false;
        if (view.slots[slot].holders.load(.monotonic) & mine == 0) return false;
    }
    return true;
}

fn buffer_status(status: buffer.Status) i32 {
    return @intFromEnum(status);
}

fn buffer_slots_valid(view: buffer.Buffer, slots: []const u32) bool {
    for (slots) |slot| {
        if (slot >= view.slots.len) return false;
    }
    return true;
}

fn ids_slice(ids: [*]const buffer.BlockId, n: u32) []const buffer.BlockId {
    return ids[0..n];
}

pub export fn ucm_buffer_ctrl_size_bytes(geometry: *const buffer.Geometry) i64 {
    const status = buffer.validate_geometry(geometry.*);
    if (status != .ok) return buffer_status(status);
    return @intCast(buffer.ctrl_size_bytes(geometry.*));
}

pub export fn ucm_buffer_init(ctrl: usize, ctrl_bytes: u64, geometry: *const buffer.Geometry, creator_start_time: u64) i32 {
    return buffer_status(buffer.Buffer.init(ctrl, ctrl_bytes, geometry.*, creator_start_time));
}

pub export fn ucm_buffer_attach(ctrl: usize, ctrl_bytes: u64, expected: ?*const buffer.Geometry) i32 {
    return buffer_status(buffer.Buffer.attach(ctrl, ctrl_bytes, if (expected) |g| g.* else null));
}

/// Copies the header of an initialised region (for error messages and tools).
pub export fn ucm_buffer_header(ctrl: usize, out: *buffer.Header) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    out.* = view.header.*;
    return 0;
}

/// Registers the calling process as a holder (idempotent); returns its index 0..63 or a
/// negative status (holders_full when 64 live processes hold entries).
pub export fn ucm_buffer_register(ctrl: usize) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const holder = view.register() catch |err| return switch (err) {
        error.HoldersFull => buffer_status(.holders_full),
        error.LockTimeout => buffer_status(.lock_timeout),
    };
    return holder;
}

/// Drops every reference of dead holders and frees their entries. Returns references dropped;
/// `out_holders` receives the holders freed.
pub export fn ucm_buffer_reclaim_dead(ctrl: usize, out_holders: *u32) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const report = view.reclaim_dead() catch return buffer_status(.lock_timeout);
    out_holders.* = report.holders;
    return @intCast(report.refs);
}

/// Copies holder entry `index` (tag = state << 32 | pid, start time, reclaimer).
pub export fn ucm_buffer_holder_info(ctrl: usize, index: u32, out: *buffer.HolderEntry) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (index >= view.holder_table.entries.len) return buffer_status(.invalid_argument);
    const entry = &view.holder_table.entries[index];
    out.* = .{
        .tag = std.atomic.Value(u64).init(entry.tag.load(.acquire)),
        .start_time = std.atomic.Value(u64).init(entry.start_time.load(.monotonic)),
        .reclaimer = std.atomic.Value(u32).init(entry.reclaimer.load(.monotonic)),
        .closing = std.atomic.Value(u32).init(entry.closing.load(.monotonic)),
        ._pad1 = 0,
    };
    return 0;
}

/// Registers namespace `tag` (the first 8 bytes of its keys, little-endian; 0: the default
/// namespace) with its guarantee and cap in slots, or updates them. Returns its index in the
/// namespace table, or a negative status: invalid_argument (guarantee > cap, cap > slots),
/// namespaces_full, guarantees_over (the guarantees would exceed the regular slots).
pub export fn ucm_buffer_register_namespace(ctrl: usize, tag: u64, guarantee_slots: u32, cap_slots: u32) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const index = view.register_namespace(tag, guarantee_slots, cap_slots) catch |err| return switch (err) {
        error.InvalidArgument => buffer_status(.invalid_argument),
        error.NamespacesFull => buffer_status(.namespaces_full),
        error.GuaranteesOver => buffer_status(.guarantees_over),
        error.LockTimeout => buffer_status(.lock_timeout),
    };
    return index;
}

/// Enters namespace `tag` (not 0) with its name (`name_len` bytes, 1 to
/// `buffer_namespace_name_max_bytes`) in the control plane's identity table: the only
/// authority on which tag is whose. Returns the entry's index, or a negative status:
/// invalid_argument, names_full, name_conflict (the tag is another name's), lock_timeout.
pub export fn ucm_buffer_register_namespace_name(ctrl: usize, tag: u64, name: [*]const u8, name_len: u32) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (name_len > constants.buffer_namespace_name_max_bytes) return buffer_status(.invalid_argument);
    const index = view.register_namespace_name(tag, name[0..name_len]) catch |err| return switch (err) {
        error.InvalidArgument => buffer_status(.invalid_argument),
        error.NamesFull => buffer_status(.names_full),
        error.NameConflict => buffer_status(.name_conflict),
        error.LockTimeout => buffer_status(.lock_timeout),
    };
    return @intCast(index);
}

/// Copies the identity entry of `tag` (not 0) into `out`: 1 when the tag is entered, else 0
/// (the tag is no registered namespace's: its keys are the default namespace's).
pub export fn ucm_buffer_namespace_name(ctrl: usize, tag: u64, out: *buffer.NamespaceName) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (tag == 0) return 0;
    const index = view.namespace_name_find(tag) orelse return 0;
    view.namespace_name_copy(index, out);
    return 1;
}

/// Copies every complete identity entry into `out` (room for `capacity` entries, at most
/// `buffer_namespace_names_max` are ever used); returns how many it copied.
pub export fn ucm_buffer_namespace_names(ctrl: usize, out: [*]buffer.NamespaceName, capacity: u32) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    var copied: u32 = 0;
    var index: u32 = 0;
    while (index < constants.buffer_namespace_names_max and copied < capacity) : (index += 1) {
        view.namespace_name_copy(index, &out[copied]);
        if (out[copied].name_len_bytes.load(.monotonic) != 0) copied += 1;
    }
    return @intCast(copied);
}

/// Copies namespace entry `index` (tag, state, guarantee, cap, occupancy in slots, hits,
/// misses, evictions).
pub export fn ucm_buffer_namespace_info(ctrl: usize, index: u32, out: *buffer.NamespaceEntry) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (index >= view.namespace_table.entries.len) return buffer_status(.invalid_argument);
    const entry = &view.namespace_table.entries[index];
    // Monotonic: a snapshot for stats; each field is read once.
    out.* = .{
        .tag = .init(entry.tag.load(.monotonic)),
        .state = .init(entry.state.load(.acquire)),
        .guarantee_slots = .init(entry.guarantee_slots.load(.monotonic)),
        .cap_slots = .init(entry.cap_slots.load(.monotonic)),
        .occupancy_slots = .init(entry.occupancy_slots.load(.monotonic)),
        .hits = .init(entry.hits.load(.monotonic)),
        .misses = .init(entry.misses.load(.monotonic)),
        .evictions = .init(entry.evictions.load(.monotonic)),
        ._pad = @splat(0),
    };
    return 0;
}

/// Reads `count` control records: names (16 bytes each, packed) at `names`; for each, its
/// value into `out_values` and 1 into `out_found` when the buffer holds it, else 0 and 0.
pub export fn ucm_buffer_control_read(ctrl: usize, names: [*]const u8, count: u32, out_values: [*]u64, out_found: [*]u8) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (count > constants.buffer_control_read_names_max) return buffer_status(.invalid_argument);
    const name_bytes = constants.buffer_control_name_size_bytes;
    for (0..count) |index| {
        const name: *const buffer.Buffer.ControlName = @ptrCast(names + index * name_bytes);
        const value = view.control_read(name);
        out_values[index] = value orelse 0;
        out_found[index] = @intFromBool(value != null);
    }
    return 0;
}

/// Raises control record `name` (16 bytes) to at least `value`; writes its value after the
/// raise to `out_value`. controls_full when the name is new and every entry is taken.
pub export fn ucm_buffer_control_raise(ctrl: usize, name: [*]const u8, value: u64, out_value: *u64) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const record: *const buffer.Buffer.ControlName = @ptrCast(name);
    out_value.* = view.control_raise(record, value) catch |err| return switch (err) {
        error.ControlsFull => buffer_status(.controls_full),
    };
    return 0;
}

/// The dead-holder mask after checking every live holder (pid + start time).
pub export fn ucm_buffer_scan_holders(ctrl: usize, out_mask: *u64) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    out_mask.* = view.scan_holders();
    return 0;
}

/// Test hook: records another start time for holder `index`, as if its pid had been reused.
pub fn ucm_buffer_debug_set_holder_start_time(ctrl: usize, index: u32, start_time: u64) callconv(.c) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (index >= view.holder_table.entries.len) return buffer_status(.invalid_argument);
    view.debug_set_start_time(index, start_time);
    return 0;
}

pub export fn ucm_buffer_get(
    ctrl: usize,
    holder: u32,
    n: u32,
    ids: [*]const buffer.BlockId,
    shards: [*]const u32,
    out_results: [*]buffer.GetResult,
    out_slots: [*]u32,
) i32 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    view.get(ids_slice(ids, n), shards[0..n], .{
        .results = out_results[0..n],
        .slots = out_slots[0..n],
    });
    return 0;
}

pub export fn ucm_buffer_commit(ctrl: usize, holder: u32, n: u32, slots: [*]const u32, states: [*]const u8, out: [*]buffer.CommitResult) i32 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    if (!buffer_slots_valid(view, slots[0..n])) return buffer_status(.invalid_argument);
    for (states[0..n]) |state| {
        if (!buffer.Buffer.commit_code_valid(state)) return buffer_status(.invalid_argument);
    }
    view.commit(slots[0..n], states[0..n], out[0..n]);
    return 0;
}

pub export fn ucm_buffer_wait(ctrl: usize, holder: u32, n: u32, slots: [*]const u32, timeout_ns: u64, out: [*]buffer.WaitResult) i32 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    if (!buffer_slots_held(view, slots[0..n])) return buffer_status(.invalid_argument);
    view.wait(slots[0..n], timeout_ns, out[0..n]);
    return 0;
}

/// `ucm_buffer_commit` for one slot, without arrays: the single-shard commit sits on every
/// waiter's wake-up latency and runs cold, where each argument array the caller builds costs
/// microseconds. Returns the CommitResult code (>= 0) or a negative Status.
pub export fn ucm_buffer_commit_one(ctrl: usize, holder: u32, slot: u32, state: u8) i32 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    const slots = [1]u32{slot};
    if (!buffer_slots_valid(view, &slots)) return buffer_status(.invalid_argument);
    if (!buffer.Buffer.commit_code_valid(state)) return buffer_status(.invalid_argument);
    var out = [1]buffer.CommitResult{.ok};
    view.commit(&slots, &[1]u8{state}, &out);
    return @intFromEnum(out[0]);
}

/// `ucm_buffer_wait` for one slot, without arrays (the waiter returns cold from the futex).
/// Returns the WaitResult code (>= 0) or a negative Status.
pub export fn ucm_buffer_wait_one(ctrl: usize, holder: u32, slot: u32, timeout_ns: u64) i32 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    const slots = [1]u32{slot};
    if (!buffer_slots_held(view, &slots)) return buffer_status(.invalid_argument);
    var out = [1]buffer.WaitResult{.idle};
    view.wait(&slots, timeout_ns, &out);
    return @intFromEnum(out[0]);
}

pub export fn ucm_buffer_release(ctrl: usize, holder: u32, n: u32, slots: [*]const u32) i64 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    if (!buffer_slots_held(view, slots[0..n])) return buffer_status(.invalid_argument);
    // A slot listed twice is released once (the second finds no reference): count < n.
    return view.release(slots[0..n]);
}

/// Claims up to `capacity` dirty slots for writing down (`Buffer.take_dirty`), scanning from
/// `cursor.*` (updated). Returns how many were claimed, or a negative Status.
pub export fn ucm_buffer_take_dirty(
    ctrl: usize,
    holder: u32,
    cursor: *u32,
    capacity: u32,
    out_slots: [*]u32,
    out_ids: [*]buffer.BlockId,
    out_shards: [*]u32,
) i64 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    return view.take_dirty(cursor, .{
        .slots = out_slots[0..capacity],
        .block_ids = out_ids[0..capacity],
        .shard_indices = out_shards[0..capacity],
    });
}

/// Ends the flush of slots from `ucm_buffer_take_dirty`: `written[i]` != 0 pays slot i's debt.
/// The references taken stay (release them). Returns how many were cleaned, or a negative Status.
pub export fn ucm_buffer_clean(ctrl: usize, holder: u32, n: u32, slots: [*]const u32, written: [*]const u8) i64 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    if (!buffer_slots_held(view, slots[0..n])) return buffer_status(.invalid_argument);
    return view.clean(slots[0..n], written[0..n]);
}

/// Marks the calling holder closing (`closing` != 0) or open again; returns 1 when it is the
/// last live holder not closing (it must pay the write-back debt), 0 otherwise.
pub export fn ucm_buffer_mark_closing(ctrl: usize, holder: u32, closing: u32) i32 {
    const view = switch (buffer_open_holder(ctrl, holder)) {
        .view => |v| v,
        .status => |code| return code,
    };
    return @intFromBool(view.mark_closing(closing != 0));
}

pub export fn ucm_buffer_prealloc(ctrl: usize, n: u32, ids: [*]const buffer.BlockId, shards: [*]const u32, out: [*]buffer.PreallocResult) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    view.prealloc(ids_slice(ids, n), shards[0..n], out[0..n]);
    return 0;
}

pub export fn ucm_buffer_touch(ctrl: usize, n: u32, ids: [*]const buffer.BlockId) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const touched = view.touch(ids_slice(ids, n)) catch return buffer_status(.lock_timeout);
    return @intCast(touched);
}

pub export fn ucm_buffer_lookup(ctrl: usize, n: u32, ids: [*]const buffer.BlockId, shards: [*]const u32, out: [*]u8) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    view.lookup(ids_slice(ids, n), shards[0..n], out[0..n]) catch return buffer_status(.lock_timeout);
    return 0;
}

/// `out[i]`: uses of key i's resident slot (`Slot.reuses`, saturating), 0 when absent.
pub export fn ucm_buffer_reuses(ctrl: usize, n: u32, ids: [*]const buffer.BlockId, shards: [*]const u32, out: [*]u16) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    view.reuses(ids_slice(ids, n), shards[0..n], out[0..n]) catch return buffer_status(.lock_timeout);
    return 0;
}

pub export fn ucm_buffer_lookup_blocks(ctrl: usize, n: u32, ids: [*]const buffer.BlockId, shards_per_block: u32, out: [*]u8) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (shards_per_block == 0) return buffer_status(.invalid_argument);
    view.lookup_blocks(ids_slice(ids, n), shards_per_block, out[0..n]) catch
        return buffer_status(.lock_timeout);
    return 0;
}

pub export fn ucm_buffer_remove(ctrl: usize, n: u32, ids: [*]const buffer.BlockId, shards: [*]const u32, force: bool) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const removed = view.remove(ids_slice(ids, n), shards[0..n], force) catch
        return buffer_status(.lock_timeout);
    return @intCast(removed);
}

pub export fn ucm_buffer_remove_blocks(ctrl: usize, n: u32, ids: [*]const buffer.BlockId, force: bool) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const removed = view.remove(ids_slice(ids, n), null, force) catch
        return buffer_status(.lock_timeout);
    return @intCast(removed);
}

/// Lists the keys of up to `capacity` Ready slots from slot `cursor.*` on (`Buffer.list_ready`;
/// the cursor moves on, 0 once the last slot was scanned). Returns how many were listed, or a
/// negative Status.
pub export fn ucm_buffer_list_ready(ctrl: usize, cursor: *u32, capacity: u32, out_ids: [*]buffer.BlockId, out_shards: [*]u32) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (cursor.* >= view.slots.len) return buffer_status(.invalid_argument);
    const listed = view.list_ready(cursor, .{
        .block_ids = out_ids[0..capacity],
        .shard_indices = out_shards[0..capacity],
    }) catch return buffer_status(.lock_timeout);
    return listed;
}

/// Copies up to `capacity` counters (in buffer.counter_names order); returns how many exist.
pub export fn ucm_buffer_stats(ctrl: usize, out: [*]u64, capacity: u32) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    for (0..@min(capacity, buffer.counter_count)) |index| {
        out[index] = view.counter_value(@enumFromInt(index));
    }
    return buffer.counter_count;
}

/// Adds `amount` to the node-wide `write_through_skipped` counter: shard writes a rank's dumps
/// skipped in its `write: through` tiers (the rank counts them; the buffer only sums them up).
pub export fn ucm_buffer_count_write_through_skipped(ctrl: usize, amount: u64) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    view.count(.write_through_skipped, amount);
    return 0;
}

/// Per slot: the segment index and byte offset within it.
pub export fn ucm_buffer_slot_locations(ctrl: usize, n: u32, slots: [*]const u32, out_segments: [*]u32, out_offsets: [*]u64) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (!buffer_slots_valid(view, slots[0..n])) return buffer_status(.invalid_argument);
    for (slots[0..n], out_segments[0..n], out_offsets[0..n]) |slot, *segment, *offset| {
        const location = view.slot_location(slot);
        segment.* = location.segment;
        offset.* = location.offset_bytes;
    }
    return 0;
}

/// Per slot: segment_bases[segment] + offset, or 0 where that base is 0 (scheduler: no data).
pub export fn ucm_buffer_slot_addresses(ctrl: usize, n: u32, slots: [*]const u32, segment_bases: [*]const u64, segment_count: u32, out: [*]u64) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (!buffer_slots_valid(view, slots[0..n])) return buffer_status(.invalid_argument);
    if (segment_count != view.header.segment_count) return buffer_status(.invalid_argument);
    for (slots[0..n], out[0..n]) |slot, *address| {
        const location = view.slot_location(slot);
        const base = segment_bases[location.segment];
        address.* = if (base == 0) 0 else base + location.offset_bytes;
    }
    return 0;
}

pub fn ucm_buffer_debug_slot(ctrl: usize, slot: u32, out: *buffer.Slot) callconv(.c) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (slot >= view.slots.len) return buffer_status(.invalid_argument);
    out.* = view.slots[slot];
    return 0;
}

/// The slot holding a key (any state), or -1.
pub fn ucm_buffer_debug_find(ctrl: usize, id: *const buffer.BlockId, shard: u32) callconv(.c) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    const found = view.find_locked(id, shard) catch return buffer_status(.lock_timeout);
    return if (found) |slot| slot else -1;
}

/// CLOCK cursor position of pool 0 (regular) or 1 (reserved).
pub fn ucm_buffer_debug_cursor(ctrl: usize, pool: u32) callconv(.c) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (pool > 1) return buffer_status(.invalid_argument);
    return view.cursor_position(if (pool == 0) .regular else .reserved);
}

pub fn ucm_buffer_debug_bucket_of(ctrl: usize, id: *const buffer.BlockId) callconv(.c) i64 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    return view.bucket_of(id);
}

/// Test hook: take a bucket lock and keep it (the caller is then killed to test recovery).
pub fn ucm_buffer_debug_hold_lock(ctrl: usize, bucket_index: u32) callconv(.c) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (bucket_index >= view.buckets.len) return buffer_status(.invalid_argument);
    view.debug_hold_lock(bucket_index) catch return buffer_status(.lock_timeout);
    return 0;
}

pub fn ucm_buffer_debug_drop_lock(ctrl: usize, bucket_index: u32) callconv(.c) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    if (bucket_index >= view.buckets.len) return buffer_status(.invalid_argument);
    const holder = view.buckets[bucket_index].lock.load(.monotonic) & 0x7FFF_FFFF;
    if (holder != view.pid) return buffer_status(.invalid_argument);
    view.debug_drop_lock(bucket_index);
    return 0;
}

/// Test hook: take the namespace registration lock and keep it (the caller is then killed to
/// test recovery).
pub fn ucm_buffer_debug_hold_registration_lock(ctrl: usize) callconv(.c) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    view.debug_hold_registration_lock() catch return buffer_status(.lock_timeout);
    return 0;
}

/// Test hook (this process only): pause between reading version+state and blocking in wait.
pub fn ucm_buffer_debug_set_wait_pause_ns(pause_ns: u64) callconv(.c) void {
    buffer.debug_wait_pause_ns = pause_ns;
}
/// Slot counts by where the slots are (buffer.zig `Occupancy`), for the metrics gauges.
pub export fn ucm_buffer_occupancy(ctrl: usize, out: *buffer.Occupancy) i32 {
    const view = buffer_open(ctrl) orelse return buffer_status(.bad_magic);
    out.* = view.occupancy();
    return 0;
}
// ---- end CacheBuffer ----

// ---- The removal log (removal_log.zig) ----
// A log is the CacheBuffer's (`ucm_buffer_removal_log` gives its address) or a process's own
// (`removal_log_size_bytes` of zeroed, 64-byte aligned memory, `ucm_removal_log_init`).
const removal_log = @import("removal_log.zig");

fn removal_log_at(log_addr: usize) ?*removal_log.Log {
    if (log_addr == 0 or log_addr % constants.buffer_cache_line_bytes != 0) return null;
    return @ptrFromInt(log_addr);
}

/// The address of the removal log inside the control region at `ctrl` (0: not a buffer).
pub export fn ucm_buffer_removal_log(ctrl: usize) usize {
    const view = buffer_open(ctrl) orelse return 0;
    return @intFromPtr(view.removal_log);
}

/// Initialises a process's own log at `log_addr` (`removal_log_size_bytes` bytes).
pub export fn ucm_removal_log_init(log_addr: usize) i32 {
    const log = removal_log_at(log_addr) orelse return @intFromEnum(Error.invalid_argument);
    log.init();
    return 0;
}

/// The latest removal generation of the log (a writer reads it before it captures its data).
pub export fn ucm_removal_log_generation(log_addr: usize) i64 {
    const log = removal_log_at(log_addr) orelse return @intFromEnum(Error.invalid_argument);
    return @intCast(log.current());
}

/// Records a removal (`kind`: removal_log.Kind; `id`: 16 bytes) and returns its generation.
pub export fn ucm_removal_log_append(log_addr: usize, kind: u64, id: *const removal_log.Id) i64 {
    const log = removal_log_at(log_addr) orelse return @intFromEnum(Error.invalid_argument);
    const tag = std.meta.intToEnum(removal_log.Kind, kind) catch return @intFromEnum(Error.invalid_argument);
    return @intCast(log.append(tag, id.*));
}

/// Copies the removals after generation `since` into `out` (room for `capacity`, at most
/// `removal_log_read_max`); `out_latest` receives the latest generation. Returns the count,
/// or -2 when the window is incomplete (the ring wrapped past it, an entry still being
/// written, more than `capacity`): the caller fails closed.
pub export fn ucm_removal_log_read(log_addr: usize, since: u64, out: [*]removal_log.Record, capacity: u32, out_latest: *u64) i64 {
    const log = removal_log_at(log_addr) orelse return @intFromEnum(Error.invalid_argument);
    if (capacity > constants.removal_log_read_max) return @intFromEnum(Error.invalid_argument);
    const window = log.read(since, out[0..capacity]);
    out_latest.* = window.latest;
    if (!window.complete) return removal_log_incomplete;
    return window.count;
}

/// `ucm_removal_log_read`'s answer for a window the ring no longer holds whole.
pub const removal_log_incomplete: i64 = -2;

// ---- The native load queue ----
// One queue per worker process and buffer (queue.zig). The caller's arrays passed to
// ucm_queue_submit must stay valid until the task completes (ucm_queue_done returns 1).
const queue_module = @import("queue.zig");
const populate_module = @import("populate.zig");

fn queue_status(status: queue_module.Status) i32 {
    return @intFromEnum(status);
}

fn queue_handle(handle: usize) ?*queue_module.Queue {
    if (handle == 0 or handle % @alignOf(queue_module.Queue) != 0) return null;
    const queue: *queue_module.Queue = @ptrFromInt(handle);
    return queue;
}

/// The queue of `handle`, refusing a call from another process (a fork() child).
fn queue_of(handle: usize) union(enum) { queue: *queue_module.Queue, status: i32 } {
    const queue = queue_handle(handle) orelse return .{ .status = queue_status(.invalid_argument) };
    if (queue.pid != buffer.current_pid()) return .{ .status = queue_status(.wrong_process) };
    return .{ .queue = queue };
}

/// Creates the queue of this process over the control region at `ctrl` (holder `holder`, which
/// must be registered to the caller) and the data segments at `segment_bases`. `region` is the
/// ucm_seg handle whose populater faults slot pages in before they are written (0: none).
/// `ctrl` 0: a null buffer, for a stack without one (no holder, segments or region; every key
/// is BYPASS work, and the queue takes no dumps).
pub export fn ucm_queue_create(
    ctrl: usize,
    holder: u32,
    region: usize,
    segment_bases: ?[*]const u64,
    segment_count: u32,
    settings: *const queue_module.Settings,
    tensor_sizes: [*]const u64,
    out_handle: *usize,
) i32 {
    var view: ?buffer.Buffer = null;
    if (ctrl != 0) {
        view = switch (buffer_open_holder(ctrl, holder)) {
            .view => |v| v,
            .status => |code| return code,
        };
        if (segment_count != view.?.header.segment_count) return queue_status(.invalid_argument);
    } else if (segment_count != 0 or region != 0) {
        return queue_status(.invalid_argument);
    }
    if (!queue_module.Queue.validate_settings(settings.*, view)) return queue_status(.invalid_argument);
    var total: u64 = 0;
    for (tensor_sizes[0..settings.tensor_count]) |size| {
        if (size == 0) return queue_status(.invalid_argument);
        total +|= size;
    }
    if (total != settings.shard_size_bytes) return queue_status(.invalid_argument);
    const bases_raw: []const u64 = if (segment_count == 0) &.{} else (segment_bases orelse return queue_status(.invalid_argument))[0..segment_count];
    for (bases_raw) |base| {
        if (base == 0) return queue_status(.invalid_argument);
    }
    var populater: ?*const populate_module.Populater = null;
    if (region != 0) {
        const seg = seg_handle(region) orelse return queue_status(.invalid_argument);
        if (seg.mapping.base == 0) return queue_status(.invalid_argument);
        populater = &seg.populater;
    }
    const bases: []const usize = @ptrCast(bases_raw);
    const queue = queue_module.Queue.create(std.heap.page_allocator, view, settings.*, tensor_sizes[0..settings.tensor_count], bases, populater) catch |err| {
        return queue_status(switch (err) {
            error.OutOfMemory, error.SystemResources => .out_of_memory,
        });
    };
    out_handle.* = @intFromPtr(queue);
    return 0;
}

/// Hands a task over: `n` keys (`ids`, `shards`), `addresses` (n * tensor_count caller
/// addresses: destinations of a load, sources of a dump; null for a prefetch), optional
/// `entry_flags` (load only), `results` (n bytes the queue fills with EntryResult codes) and
/// the caller's `tag`, echoed by ucm_queue_next_work. Blocks up to `timeout_ns` while the lane
/// is full. Writes the task's token.
pub export fn ucm_queue_submit(
    handle: usize,
    kind: u32,
    flags: u32,
    n: u32,
    ids: [*]const buffer.BlockId,
    shards: [*]const u32,
    addresses: ?[*]const u64,
    entry_flags: ?[*]const u8,
    results: [*]u8,
    tag: u64,
    timeout_ns: u64,
    out_token: *u64,
) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    const task_kind = std.meta.intToEnum(queue_module.TaskKind, kind) catch return queue_status(.invalid_argument);
    if (n > constants.queue_task_keys_max) return queue_status(.invalid_argument);
    const tensors: usize = queue.settings.tensor_count;
    const submission: queue_module.Queue.Submission = .{
        .kind = task_kind,
        .flags = flags,
        .ids = ids[0..n],
        .shards = shards[0..n],
        .addresses = if (addresses) |a| a[0 .. n * tensors] else null,
        .entry_flags = if (entry_flags) |f| f[0..n] else null,
        .results = results[0..n],
        .tag = tag,
    };
    if (!queue.validate(submission)) return queue_status(.invalid_argument);
    out_token.* = queue.submit(submission, timeout_ns) catch |err| return queue_status(switch (err) {
        error.Full => .full,
        error.Closed => .closed,
    });
    return 0;
}

/// 1 when the task of `token` completed (its results are final), else 0.
pub export fn ucm_queue_done(handle: usize, token: u64) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    const finished = queue.done(token) orelse return queue_status(.invalid_argument);
    return @intFromBool(finished);
}

/// Blocks (futex) until the task completes: 1, or 0 when `timeout_ns` passed first.
pub export fn ucm_queue_wait(handle: usize, token: u64, timeout_ns: u64) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    const finished = queue.wait(token, timeout_ns) orelse return queue_status(.invalid_argument);
    return @intFromBool(finished);
}

/// Takes one batch of work for a loader (at most `capacity` items of one task and kind),
/// waiting up to `timeout_ns`: the count (0 when none came), or `closed` once the queue stopped.
pub export fn ucm_queue_next_work(
    handle: usize,
    timeout_ns: u64,
    capacity: u32,
    out_tags: [*]u64,
    out_tokens: [*]u64,
    out_entries: [*]u32,
    out_slots: [*]u32,
    out_steps: [*]u32,
    out_addresses: [*]u64,
    out_kinds: [*]u8,
) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (capacity == 0 or capacity > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    var items: [constants.queue_work_batch_max]queue_module.WorkItem = undefined;
    const taken = queue.next_work(timeout_ns, items[0..@min(capacity, items.len)]) orelse
        return queue_status(.closed);
    for (items[0..taken], 0..) |item, i| {
        const task = &queue.tasks[item.task];
        out_tags[i] = task.tag;
        out_tokens[i] = (@as(u64, item.generation) << 32) | item.task;
        out_entries[i] = item.entry;
        out_slots[i] = item.slot;
        out_steps[i] = item.step;
        out_kinds[i] = @intFromEnum(item.kind);
        out_addresses[i] = if (item.slot == buffer.slot_none) 0 else queue.slot_address_of(item.slot);
    }
    return @intCast(taken);
}

/// A loader's results for work items it took (echoing tokens, entries, slots, steps, kinds),
/// with `states` (1 ready, 2 failed, 3 missing). Items refused (not handed out, reported
/// twice) are skipped; returns how many were applied.
pub export fn ucm_queue_work_done(
    handle: usize,
    n: u32,
    tokens: [*]const u64,
    entries: [*]const u32,
    slots: [*]const u32,
    steps: [*]const u32,
    kinds: [*]const u8,
    states: [*]const u8,
) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (n > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    var applied: i32 = 0;
    for (0..n) |i| {
        const kind = std.meta.intToEnum(queue_module.WorkKind, kinds[i]) catch continue;
        const state = std.meta.intToEnum(queue_module.WorkState, states[i]) catch continue;
        const report: queue_module.Queue.Report = .{
            .token = tokens[i],
            .entry = entries[i],
            .slot = slots[i],
            .step = steps[i],
            .kind = kind,
            .state = state,
        };
        if (!queue.accept_report(report)) continue;
        queue.work_done(report);
        applied += 1;
    }
    return applied;
}

/// Refuses new tasks and blocks until every task completed: 1, or 0 when `timeout_ns` passed.
pub export fn ucm_queue_drain(handle: usize, timeout_ns: u64) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    return @intFromBool(queue.drain(timeout_ns));
}

/// Stops every thread of the queue; ucm_queue_next_work then returns `closed`. Idempotent.
pub export fn ucm_queue_stop(handle: usize) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    queue.stop_and_join();
    return 0;
}

/// Frees a stopped queue (no loader may be inside ucm_queue_next_work).
pub export fn ucm_queue_destroy(handle: usize) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    queue.destroy();
    return 0;
}

/// A flusher claims up to `capacity` dirty slots through the queue (`Buffer.take_dirty`, the
/// references counted as this process's uses), scanning from `cursor.*` (updated). Returns how
/// many were claimed; release them with ucm_queue_release.
pub export fn ucm_queue_take_dirty(handle: usize, cursor: *u32, capacity: u32, out_slots: [*]u32, out_ids: [*]buffer.BlockId, out_shards: [*]u32) i64 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (capacity == 0 or capacity > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    return queue.take_dirty(cursor, .{
        .slots = out_slots[0..capacity],
        .block_ids = out_ids[0..capacity],
        .shard_indices = out_shards[0..capacity],
    });
}

/// Admission (`Queue.take_admitted`, `Buffer.admit`): `out_slots[i]` is the slot of key i
/// now admitted to lower tier `tier` and held for writing down, or slot_none. Returns how many
/// were admitted; release them with ucm_queue_release.
pub export fn ucm_queue_take_admitted(handle: usize, n: u32, ids: [*]const buffer.BlockId, shards: [*]const u32, reuses_min: u32, tier: u32, mature: bool, needs_mature: bool, out_slots: [*]u32) i64 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (n > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    if (tier >= buffer.admission_tiers_max or reuses_min > buffer.reuses_max) return queue_status(.invalid_argument);
    return queue.take_admitted(ids[0..n], shards[0..n], .{
        .reuses_min = @intCast(reuses_min),
        .tier = tier,
        .mature = mature,
        .needs_mature = needs_mature,
    }, out_slots[0..n]);
}

/// Undoes the admission of slots taken with ucm_queue_take_admitted and not yet released,
/// whose write to lower tier `tier` failed (`Queue.unadmit`): a later check admits them again.
/// Returns how many admitted bits were cleared, or a negative Status (invalid_argument when a
/// slot is not one this process holds).
pub export fn ucm_queue_unadmit(handle: usize, n: u32, slots: [*]const u32, tier: u32) i64 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (n > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    if (tier >= buffer.admission_tiers_max) return queue_status(.invalid_argument);
    const cleared = queue.unadmit(slots[0..n], tier) orelse return queue_status(.invalid_argument);
    return cleared;
}

/// Pins the keys that are Ready in the buffer (`Queue.pin`): `out_slots[i]` is the slot now
/// held for key i, or slot_none (nothing held). Returns how many were pinned; release them
/// with ucm_queue_unpin.
pub export fn ucm_queue_pin(handle: usize, n: u32, ids: [*]const buffer.BlockId, shards: [*]const u32, out_slots: [*]u32) i64 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (n > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    return queue.pin(ids[0..n], shards[0..n], out_slots[0..n]);
}

/// Releases pins taken with ucm_queue_pin (the slots it returned, slot_none left out). The
/// array is reordered (scratch).
pub export fn ucm_queue_unpin(handle: usize, n: u32, slots: [*]u32) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (n > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    if (!queue.unpin(slots[0..n])) return queue_status(.invalid_argument);
    return 0;
}

/// Releases slots taken with ucm_queue_take_dirty. The array is reordered (scratch).
pub export fn ucm_queue_release(handle: usize, n: u32, slots: [*]u32) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (n > constants.queue_step_keys_max) return queue_status(.invalid_argument);
    if (!queue.release_taken(slots[0..n])) return queue_status(.invalid_argument);
    return 0;
}

/// Copies up to `capacity` counters (queue.counter_names order); returns how many exist.
/// `out_held` receives the slots this process holds through the queue.
pub export fn ucm_queue_stats(handle: usize, out: [*]u64, capacity: u32, out_held: *u32) i32 {
    const queue = queue_handle(handle) orelse return queue_status(.invalid_argument);
    for (0..@min(capacity, queue_module.counter_count)) |index| {
        out[index] = queue.counter_value(@enumFromInt(index));
    }
    out_held.* = queue.held_slot_count();
    return queue_module.counter_count;
}
/// RearrangeIndex (queue.zig `walk_order`): writes the order in which a rank's dispatcher
/// walks a task of `n` entries (a permutation of 0..n) into `out` (n entries). `rearrange` 0:
/// natural order, the benchmarks' baseline. Returns n, or invalid_argument.
pub export fn ucm_queue_walk_order(n: u32, device_id: u32, local_rank_size: u32, rearrange: u32, out: ?[*]u32) i32 {
    if (local_rank_size == 0 or local_rank_size > constants.queue_local_rank_size_max) return queue_status(.invalid_argument);
    if (rearrange > 1 or n > constants.queue_task_keys_max) return queue_status(.invalid_argument);
    if (n == 0) return 0;
    const positions = out orelse return queue_status(.invalid_argument);
    const walk = queue_module.walk_order(n, device_id, local_rank_size, rearrange == 1);
    const written = queue_module.walk_positions(walk, positions[0..n]);
    std.debug.assert(written == n);
    return @intCast(written);
}

/// A stack without a buffer: counts the dumps Python wrote into its top tier in the queue's
/// counters (`dumped_shards`, `failed_shards`), the stack's one set. Refused on a buffer's queue.
pub export fn ucm_queue_count_dumps(handle: usize, dumped: u64, failed: u64) i32 {
    const queue = switch (queue_of(handle)) {
        .queue => |q| q,
        .status => |code| return code,
    };
    if (queue.buffer != null) return queue_status(.invalid_argument);
    queue.count_dumps(dumped, failed);
    return 0;
}
// ---- end native load queue ----

// ---- Segments ----
// The shared-memory segments of a buffer (seg_region.zig): open/publish/serve/stop/close on an
// opaque handle. Errors return a negative code (seg_sys.error_code) and a NUL-terminated
// sentence in the caller's `err_buf`.
const seg_sys = @import("seg_sys.zig");
const seg_region = @import("seg_region.zig");
const seg_shm = @import("shm.zig");
const seg_memfd = @import("memfd.zig");

fn seg_handle(handle: usize) ?*seg_region.Region {
    if (handle == 0 or handle % @alignOf(seg_region.Region) != 0) return null;
    return @ptrFromInt(handle);
}

/// Creates or attaches the region of `unique_id`. Returns 0 when attached (ready), 1 when this
/// process created it (initialise the control region, then call ucm_seg_publish), or a
/// negative error. `*out_handle` is set only on success.
pub export fn ucm_seg_open(
    unique_id_ptr: [*]const u8,
    unique_id_len: usize,
    ctrl_bytes: u64,
    data_bytes: u64,
    segment_bytes: u64,
    ctrl_layout_version: u32,
    role: u32,
    hugetlb_policy: u32,
    timeout_ns: u64,
    out_handle: *usize,
    err_buf: [*]u8,
    err_cap: usize,
) i32 {
    var diag = seg_sys.Diag.init(err_buf[0..err_cap]);
    const unique_id = unique_id_ptr[0..@min(unique_id_len, 4096)];
    const geometry: seg_shm.Geometry = .{
        .ctrl_bytes = ctrl_bytes,
        .data_bytes = data_bytes,
        .segment_bytes = segment_bytes,
        .ctrl_layout_version = ctrl_layout_version,
    };
    seg_region.check_arguments(unique_id, geometry, role, hugetlb_policy, &diag) catch |err| {
        return seg_sys.error_code(err);
    };
    const region = std.heap.page_allocator.create(seg_region.Region) catch {
        return seg_sys.error_code(diag.fail(error.System, "out of memory for a region handle", .{}));
    };
    region.* = .{};
    const created = seg_region.open(
        region,
        unique_id,
        geometry,
        @enumFromInt(role),
        @enumFromInt(hugetlb_policy),
        timeout_ns,
        &diag,
    ) catch |err| {
        std.heap.page_allocator.destroy(region);
        return seg_sys.error_code(err);
    };
    out_handle.* = @intFromPtr(region);
    return @intFromBool(created);
}

pub export fn ucm_seg_publish(handle: usize, err_buf: [*]u8, err_cap: usize) i32 {
    var diag = seg_sys.Diag.init(err_buf[0..err_cap]);
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (!region.created or region.published) {
        return seg_sys.error_code(diag.fail(error.InvalidArgument, "the region was not created unpublished by this handle", .{}));
    }
    seg_region.publish(region, &diag) catch |err| return seg_sys.error_code(err);
    return 0;
}

/// Serves the data descriptors until ucm_seg_stop; run it on a thread of its own. Returns 0
/// after a stop, 1 at once when this process holds no data to serve (a scheduler).
pub export fn ucm_seg_serve(handle: usize) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (!region.server.started()) return 1;
    region.server.serve();
    return 0;
}

/// Asks ucm_seg_serve to return; safe from any thread.
pub export fn ucm_seg_stop(handle: usize) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (region.server.started()) region.server.request_stop();
    return 0;
}

/// Releases the region. ucm_seg_serve must have returned.
pub export fn ucm_seg_close(handle: usize) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    seg_region.close(region);
    std.heap.page_allocator.destroy(region);
    return 0;
}

pub export fn ucm_seg_info(handle: usize, out: *seg_region.Info, out_bytes: usize) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (out_bytes != @sizeOf(seg_region.Info)) return @intFromEnum(Error.invalid_argument);
    out.* = region.info();
    return 0;
}

/// Starts `thread_count` (0..populate_threads_max) background threads that fault this process's
/// data mapping in; returns how many started (0 for a scheduler or a second call).
pub export fn ucm_seg_populate(handle: usize, thread_count: u32) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (thread_count > constants.populate_threads_max) return @intFromEnum(Error.invalid_argument);
    return @intCast(seg_region.start_population(region, thread_count));
}

/// How much of the data plane is resident (node-wide) and how far this process's populater got.
pub export fn ucm_seg_residency(handle: usize, out: *seg_region.Residency, out_bytes: usize) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (out_bytes != @sizeOf(seg_region.Residency)) return @intFromEnum(Error.invalid_argument);
    out.* = seg_region.residency(region);
    return 0;
}

/// Removes the names of `unique_id` under /dev/shm (tests, admin cleanup); returns how many
/// existed. Processes that still map the segments keep them.
pub export fn ucm_seg_unlink(unique_id_ptr: [*]const u8, unique_id_len: usize) i32 {
    const unique_id = unique_id_ptr[0..@min(unique_id_len, 4096)];
    if (!seg_sys.unique_id_valid(unique_id)) return @intFromEnum(Error.invalid_argument);
    return @intCast(seg_shm.unlink_all(unique_id));
}

/// Test hook: makes this process's fd server expect another peer uid, so the SO_PEERCRED
/// refusal path can be exercised without a second user.
pub fn ucm_seg_debug_set_peer_uid(handle: usize, uid: u32) callconv(.c) i32 {
    const region = seg_handle(handle) orelse return @intFromEnum(Error.invalid_argument);
    if (!region.server.started()) return @intFromEnum(Error.invalid_argument);
    // Monotonic: a standalone setting, see fdpass.Server.expected_uid.
    region.server.expected_uid.store(uid, .monotonic);
    return 0;
}

// ---- Test hooks ----
// The `*_debug_*` functions above are exported only by a test build of the library
// (`zig build -Ddebug-hooks=true`, libucm_core_test.so): fault injection and introspection
// that the tests and the soak use, never part of the release library.
const build_options = @import("build_options");
comptime {
    if (build_options.debug_hooks) {
        @export(&ucm_buffer_debug_set_holder_start_time, .{ .name = "ucm_buffer_debug_set_holder_start_time" });
        @export(&ucm_buffer_debug_slot, .{ .name = "ucm_buffer_debug_slot" });
        @export(&ucm_buffer_debug_find, .{ .name = "ucm_buffer_debug_find" });
        @export(&ucm_buffer_debug_cursor, .{ .name = "ucm_buffer_debug_cursor" });
        @export(&ucm_buffer_debug_bucket_of, .{ .name = "ucm_buffer_debug_bucket_of" });
        @export(&ucm_buffer_debug_hold_lock, .{ .name = "ucm_buffer_debug_hold_lock" });
        @export(&ucm_buffer_debug_drop_lock, .{ .name = "ucm_buffer_debug_drop_lock" });
        @export(&ucm_buffer_debug_hold_registration_lock, .{ .name = "ucm_buffer_debug_hold_registration_lock" });
        @export(&ucm_buffer_debug_set_wait_pause_ns, .{ .name = "ucm_buffer_debug_set_wait_pause_ns" });
        @export(&ucm_seg_debug_set_peer_uid, .{ .name = "ucm_seg_debug_set_peer_uid" });
    }
}
