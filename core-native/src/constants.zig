//! Layout constants shared by every module of the native core. Anything that is part of the
//! shared-memory layout lives here so that a change is visible in one place and checked at
//! compile time.
const std = @import("std");

/// Bumped whenever the C ABI changes; the Python binding refuses a library with another value.
pub const abi_version: u32 = 12;

/// Futex words are 32-bit on Linux, and they must be naturally aligned.
pub const futex_word_size_bytes: usize = 4;

/// Upper bound on a single futex wait, so that a waiter always gets control back to check
/// whether the owner died (fault tolerance) even when asked to wait "forever".
pub const futex_wait_slice_ns: u64 = 100 * std.time.ns_per_ms;

comptime {
    std.debug.assert(@sizeOf(u32) == futex_word_size_bytes);
    std.debug.assert(@alignOf(std.atomic.Value(u32)) == futex_word_size_bytes);
    std.debug.assert(futex_wait_slice_ns > 0);
    std.debug.assert(futex_wait_slice_ns < std.time.ns_per_s);
}

// ---- Checksums (checksum.zig) ----

/// Most memory ranges one checksum call streams over: a shard's views, one per tensor.
pub const checksum_parts_max: usize = 1 << 16;

comptime {
    std.debug.assert(checksum_parts_max > 0);
    std.debug.assert(checksum_parts_max <= std.math.maxInt(u32));
}

// ---- Copies of caller ranges (exports.zig: ucm_copy_ranges) ----

/// Most ranges one copy call moves: a load's blocks times their tensors (a caller with more
/// splits them over several calls).
pub const copy_ranges_max: usize = 1 << 20;

comptime {
    std.debug.assert(copy_ranges_max > 0);
    std.debug.assert(copy_ranges_max <= std.math.maxInt(u32));
}

// ---- The native load queue (queue.zig) ----

/// Tasks one lane (load, prefetch or dump) queues for its dispatcher at most (its depth), and
/// holds in flight at most (queued or walked, not completed).
pub const queue_lane_depth_max: u32 = 512;
/// Task records per queue (the three lanes together): the most tasks in flight at once. Each
/// lane holds at most `queue_lane_depth_max`, so no lane's tasks take another lane's records.
pub const queue_tasks_max: u32 = 3 * queue_lane_depth_max;
/// Keys one task may hold (a task is walked in steps; this only bounds counters).
pub const queue_task_keys_max: u32 = 1 << 24;
/// Keys one step claims with one batched Get (the per-lane scratch is sized by step_keys).
pub const queue_step_keys_max: u32 = 1 << 15;
/// Tensors one shard spans (one caller address each).
pub const queue_tensors_max: u32 = 1 << 12;
pub const queue_copy_threads_max: u32 = 16;
/// Work batches a step's owned keys are cut into (the loaders' concurrency).
pub const queue_fill_parts_max: u32 = 256;
pub const queue_local_rank_size_max: u32 = buffer_holders_max;
/// Work items one `ucm_queue_next_work` call hands a loader at most (its stack buffer).
pub const queue_work_batch_max: u32 = 256;
/// Items each of the work ring (to the loaders) and the copy ring holds before producers wait.
pub const queue_ring_items: usize = 1 << 16;
/// A copy thread takes this many bytes of copies at once (at least one shard), at most
/// queue_copy_batch_items shards: big enough to amortise the ring, small enough to spread
/// one task's copies over every copy thread.
pub const queue_copy_batch_bytes: u64 = 512 << 10;
pub const queue_copy_batch_items: usize = 64;
/// Keys a load step claims per batched Get before handing that piece's hits to the copy threads.
pub const queue_claim_piece_keys: usize = 64;
/// Ranges at least this long are copied with non-temporal stores (queue.copy_bytes).
pub const queue_nontemporal_min_bytes: usize = 4096;
/// Longest a blocked queue thread sleeps before re-checking its condition (stop, deadline).
pub const queue_ring_wait_slice_ns: u64 = 100 * std.time.ns_per_ms;
/// Times a wait on a slot this process is filling is renewed before loading it from below.
pub const queue_wait_rounds_max: u32 = 8;
/// Claims of one dump step's keys: the first; a second for keys that were Ready (replaced:
/// removed, then claimed again) or whose fill by another load ended Failed or Missing; a third
/// for keys whose second fill failed too. A key that still has no slot of its own after the
/// last is a NO_SLOT entry (the store writes it straight to the tiers below).
pub const queue_dump_rounds_max: u32 = 3;

comptime {
    std.debug.assert(queue_lane_depth_max >= 1);
    std.debug.assert(queue_tasks_max >= 3 * queue_lane_depth_max); // every lane at its depth
    std.debug.assert(queue_step_keys_max <= queue_task_keys_max);
    std.debug.assert(queue_ring_items >= 2 * queue_step_keys_max);
    std.debug.assert(queue_copy_batch_items > 0);
    std.debug.assert(queue_work_batch_max > 0 and queue_work_batch_max <= queue_step_keys_max);
    std.debug.assert(queue_ring_wait_slice_ns <= futex_wait_slice_ns);
    std.debug.assert(queue_dump_rounds_max >= 2); // A Ready key is replaced in the second.
}

// ---- Segments (shm.zig, memfd.zig, fdpass.zig, seg_region.zig) ----

/// Directory of the named control segments and their creation lock files.
pub const seg_shm_dir = "/dev/shm";
/// A unique id becomes part of file and abstract socket names: keep it short.
pub const seg_unique_id_max_bytes: usize = 64;
pub const seg_path_max_bytes: usize = 128;
/// "UCM-SEG1" read as a little-endian u64: the first word of every control segment.
pub const seg_magic: u64 = std.mem.readInt(u64, "UCM-SEG1", .little);
/// Bumped whenever the segment header layout (shm.Header) changes.
pub const seg_layout_version: u32 = 1;
pub const seg_page_bytes: usize = 4096;
/// The segment header owns the first page of the control segment; the caller's control region
/// (BufferCtrl) starts right after it, page-aligned.
pub const seg_header_bytes: usize = seg_page_bytes;
/// Live processes attached to one buffer at once (ranks, schedulers, restarts in flight).
pub const seg_attach_entries_max: u32 = 64;
/// Data segments per buffer, and file descriptors per SCM_RIGHTS message (the kernel allows
/// at most 253 per message).
pub const seg_segments_max: u32 = 256;
pub const seg_fd_chunk_count: u32 = 64;
/// Mappings are aligned to the x86_64/aarch64 PMD size so that huge pages can back them.
pub const seg_huge_page_bytes: usize = 2 * 1024 * 1024;
pub const seg_ctrl_bytes_max: u64 = 1 << 36;
pub const seg_data_bytes_max: u64 = 1 << 44;
/// Polling step while waiting for the creation lock (flock has no timed wait).
pub const seg_lock_poll_ns: u64 = 2 * std.time.ns_per_ms;
/// Upper bound of one poll() in the fd server loop: stop is also signalled through an eventfd,
/// this only bounds the wait if that wake-up were ever lost.
pub const seg_server_poll_ms: i32 = 500;
/// Send/receive timeout on an fd hand-over connection.
pub const seg_socket_timeout_ms: u32 = 2000;
/// How long close() tries to take the lock to unlink a segment nobody serves any more.
pub const seg_close_lock_ns: u64 = 500 * std.time.ns_per_ms;

/// Background population of the data plane (populate.zig): chunk size and thread bound.
pub const populate_chunk_bytes: usize = 32 * 1024 * 1024;
pub const populate_threads_max: u32 = 8;
pub const populate_chunks_max: usize = seg_data_bytes_max / populate_chunk_bytes;

comptime {
    std.debug.assert(populate_chunk_bytes % seg_huge_page_bytes == 0);
    std.debug.assert(populate_chunks_max % 64 == 0);
    std.debug.assert(populate_chunks_max <= std.math.maxInt(u32));
    std.debug.assert(populate_threads_max > 0);
}

comptime {
    std.debug.assert(seg_header_bytes % seg_page_bytes == 0);
    std.debug.assert(seg_huge_page_bytes % seg_page_bytes == 0);
    std.debug.assert(seg_fd_chunk_count <= 253);
    std.debug.assert(seg_segments_max % seg_fd_chunk_count == 0);
    std.debug.assert(seg_shm_dir.len + "/ucm-".len + seg_unique_id_max_bytes + 16 < seg_path_max_bytes);
    std.debug.assert(seg_lock_poll_ns < std.time.ns_per_s);
    std.debug.assert(seg_server_poll_ms > 0);
}

// ---- CacheBuffer (buffer.zig) ----

/// "UCMBUF01" little-endian: identifies an initialised CacheBuffer control region.
pub const buffer_magic: u64 = 0x3130_4655_424D_4355;
/// Bumped whenever the control-region layout changes; attach refuses another value.
/// 2: holder table after the counters; Slot.refcount/owner_pid replaced by a holder bitmap and
/// the owner's holder index. 3: slot State `missing` (the owner found the key in no tier).
/// 4: write-back debt (slot flag `dirty`, `Slot.flusher`, `HolderEntry.closing`, counters
/// `dirty_slots` and `flushed`); dirty slots are never eviction victims. 5: the namespace
/// table after the holder table; `Slot.namespace` (offset 60); `Slot.reuses` (bytes 62..63,
/// uses counted for admission) and the admitted/matured slot flag bits. 6: after the
/// namespace table, the namespace identity table (tag -> name, and the registration lock),
/// the control record table (reset epochs) and the removal log (removal_log.zig).
pub const buffer_layout_version: u32 = 6;
pub const buffer_cache_line_bytes: u64 = 64;
pub const buffer_header_size_bytes: usize = 256;
pub const buffer_clock_size_bytes: usize = 64;
pub const buffer_counters_size_bytes: usize = 192;
pub const buffer_bucket_size_bytes: usize = 8;
/// Processes holding references at once (one holder each); a slot records its holders in a
/// 64-bit bitmap, so this is also the bitmap's width.
pub const buffer_holders_max: u32 = 64;
pub const buffer_holder_entry_size_bytes: usize = 32;
pub const buffer_holder_table_size_bytes: usize = 64 + buffer_holders_max * buffer_holder_entry_size_bytes;
/// Namespaces with their own quota and occupancy counter; entry 0 is the default namespace's
/// (and every key whose tag no registered entry has). Slots record an index below this in u16.
pub const buffer_namespaces_max: u32 = 32;
pub const buffer_namespace_entry_size_bytes: usize = 64;
pub const buffer_namespace_table_size_bytes: usize = buffer_namespaces_max * buffer_namespace_entry_size_bytes;
/// Control records (a key space's reset epoch: a name and a monotonic maximum) the buffer
/// holds for every rank of the node; entries are never freed while the buffer lives.
pub const buffer_controls_max: u32 = 64;
pub const buffer_control_name_size_bytes: usize = 16;
pub const buffer_control_entry_size_bytes: usize = 32;
pub const buffer_control_table_size_bytes: usize = buffer_controls_max * buffer_control_entry_size_bytes;
/// Names one control read answers at most (a batch of key spaces).
pub const buffer_control_read_names_max: u32 = 1 << 16;
/// Namespace identities (tag -> name) in the control plane: every namespace a process uses
/// with the buffer is entered before its first key can land, so a tag found in no entry is the
/// default namespace's. Open addressing over a power-of-two table; an entry is never freed.
pub const buffer_namespace_names_max: u32 = 4096;
/// Longest namespace name (`ucm.namespaces.NAMESPACE_NAME_MAX`), stored in 8-byte words.
pub const buffer_namespace_name_max_bytes: usize = 64;
pub const buffer_namespace_name_entry_size_bytes: usize = 128;
pub const buffer_namespace_names_header_size_bytes: usize = 64;
pub const buffer_namespace_names_size_bytes: usize = buffer_namespace_names_header_size_bytes +
    buffer_namespace_names_max * buffer_namespace_name_entry_size_bytes;
/// Minimum spacing of the dead-holder scans a full buffer triggers (each reads /proc per holder).
pub const buffer_holder_scan_interval_ns: u64 = 100 * std.time.ns_per_ms;
pub const buffer_slot_size_bytes: usize = 64;
/// Slot and bucket indices are u32 with the top values reserved as sentinels.
pub const buffer_slot_count_max: u64 = 1 << 30;
pub const buffer_bucket_count_max: u64 = 1 << 28;
pub const buffer_segment_count_max: u64 = 1 << 16;
/// Keys per lock pass of a batched remove (seed 003; mirrors ucm.tier.REMOVE_CHUNK_KEYS).
pub const buffer_remove_chunk_keys: usize = 1024;
/// Bucket locks are held for a few chain steps: spin briefly before sleeping on the futex.
pub const buffer_lock_spin_count: u32 = 64;
/// A sleeping locker wakes this often to check whether the holder died.
pub const buffer_lock_wait_slice_ns: u64 = 10 * std.time.ns_per_ms;
/// A lock held longer than this by a live process is reported as a timeout, never waited out.
pub const buffer_lock_timeout_ns: u64 = 10 * std.time.ns_per_s;
/// Backstops for loops whose real bound is a deadline.
pub const buffer_lock_round_max: u32 = 1 << 24;
pub const buffer_wait_round_max: u32 = 1 << 24;
pub const buffer_cas_attempts_max: u32 = 64;

comptime {
    std.debug.assert(buffer_header_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_clock_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_counters_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_slot_size_bytes == buffer_cache_line_bytes);
    std.debug.assert(buffer_bucket_size_bytes == 2 * futex_word_size_bytes);
    std.debug.assert(buffer_holders_max == 64);
    std.debug.assert(buffer_holder_table_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_namespace_table_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_control_table_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_control_name_size_bytes + 16 == buffer_control_entry_size_bytes);
    std.debug.assert(buffer_controls_max >= 1 and buffer_control_read_names_max >= 1);
    std.debug.assert(buffer_namespaces_max >= 2 and buffer_namespaces_max < std.math.maxInt(u16));
    std.debug.assert(std.math.isPowerOfTwo(buffer_namespace_names_max));
    std.debug.assert(buffer_namespace_names_max > buffer_namespaces_max);
    std.debug.assert(buffer_namespace_name_max_bytes % 8 == 0);
    std.debug.assert(buffer_namespace_name_entry_size_bytes >= 16 + buffer_namespace_name_max_bytes);
    std.debug.assert(buffer_namespace_name_entry_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_namespace_names_header_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_namespace_names_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(buffer_slot_count_max < std.math.maxInt(u32) - 1);
    std.debug.assert(buffer_bucket_count_max < std.math.maxInt(u32) - 1);
    std.debug.assert(buffer_remove_chunk_keys == 1024);
    std.debug.assert(buffer_lock_wait_slice_ns < buffer_lock_timeout_ns);
    std.debug.assert(buffer_lock_wait_slice_ns <= futex_wait_slice_ns);
}

// ---- Removal log (removal_log.zig): what makes a purge or a forced remove final ----

/// Entries of the removal log's ring: the most purges and forced block removes a writer can
/// look back over. A writer whose window spans more fails closed (retracts all it wrote).
pub const removal_log_entries: u32 = 4096;
pub const removal_log_entry_size_bytes: usize = 32;
/// The log's header (its generation) owns one cache line; the ring follows.
pub const removal_log_header_size_bytes: usize = 64;
pub const removal_log_size_bytes: usize = removal_log_header_size_bytes + removal_log_entries * removal_log_entry_size_bytes;
/// Entries one `ucm_removal_log_read` call copies out at most (a window past this wrapped).
pub const removal_log_read_max: u32 = removal_log_entries;

comptime {
    std.debug.assert(std.math.isPowerOfTwo(removal_log_entries));
    std.debug.assert(removal_log_size_bytes % buffer_cache_line_bytes == 0);
    std.debug.assert(removal_log_header_size_bytes == buffer_cache_line_bytes);
    std.debug.assert(removal_log_read_max <= removal_log_entries);
}
