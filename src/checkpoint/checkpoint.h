// src/checkpoint/checkpoint.h — sharded checkpoints of a ZeroState: every rank writes the
// coordinates it owns, rank 0 commits them with a manifest, and a checkpoint loads into any world
// size, stage, alignment or unit partition of the same model (design.md §1, `checkpoint/`).
//
// Note [checkpoint format]
// ~~~~~~~~~~~~~~~~~~~~~~~~
//   ROOT/latest                     "step-00000020\n": the step directory committed last
//   ROOT/step-00000020/manifest.json   manifest.h: layout, optimizer, steps, files with CRC-32s,
//                                      metadata
//   ROOT/step-00000020/rank-00000.pt   one per rank of the writing run
//   ROOT/step-00000020/shared.pt       rank-independent tensors (the model's buffers and frozen
//                                      parameters, from rank 0)
// Every .pt file is the zip container torch.save writes (torch::pickle_save's, with untagged
// dicts and lists) of plain dicts, lists, strings, integers and CPU tensors, so
// `torch.load(f, weights_only=True)` reads it without dpzero. A rank file
// is {"format": "dpzero-checkpoint-rank", "version", "rank", "world_size", "step",
// "units": [{"name", "optimizer_steps", "entries": {"param": [m], <optimizer state>: [m]}}],
// "extra": {name: tensor}} with m the unit's shard_numel, units in manifest order: by Note
// [checkpoint slices] (src/zero/unit.h) rank r's entries are the unit's flat coordinates
// [r·m, (r+1)·m) in every stage, so the files hold each coordinate exactly once. Tensors are
// saved as compact CPU copies (a saved view would drag its whole storage into the file).
//
// Note [checkpoint commit]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// save() is a collective; its phases are separated by exchanges (all_gathers of each rank's
// status and a short text) that double as barriers and carry any rank's error to every rank, so
// a failure on one rank makes save() throw on all of them instead of leaving the others waiting
// in a collective.
//   1. Every rank serialises its file in memory (rank 0 also shared.pt and the manifest draft).
//   2. Rank 0 creates ROOT, refuses if ROOT/step-N exists (a committed checkpoint is never
//      overwritten), creates ROOT/.step-N.tmp-<nonce> and fsyncs ROOT. Exchange: the nonce.
//   3. Each rank writes its file into the temporary directory durably (atomic_file.h: temp name,
//      fsync, rename, directory fsync). Exchange: each file's size and CRC-32.
//   4. Rank 0 writes manifest.json (durably), renames the temporary directory to ROOT/step-N,
//      fsyncs ROOT, then replaces ROOT/latest atomically and fsyncs ROOT again. Then, with
//      keep_last, deletes older committed steps, and removes leftovers of crashed saves. Exchange.
// A step directory exists under its final name only complete (the rename is atomic and comes
// after every file and the manifest are on stable storage), and ROOT/latest only ever names such
// a directory. So a crash anywhere before the rename leaves ROOT/latest and the previous
// checkpoint untouched, plus a ".step-N.tmp-*" directory that nothing reads and the next
// successful save removes. A crash between the rename and the update of latest (a window of one
// rename and two fsyncs) leaves step-N complete but not named by latest: loading ROOT resumes
// from the previous checkpoint, and a later save of the same step refuses to overwrite step-N —
// load it by its path, or remove it (`dpzero train --resume` loads the newest committed step
// directory, not ROOT/latest: _newest_committed in python/dpzero/train/runner.py). Loading trusts
// nothing it has not checked: every file read must have the size and CRC-32 the manifest
// records, or the error names the file.
// One writer per ROOT at a time: concurrent saves into one ROOT are not supported.
//
// Note [checkpoint resharding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Parameters are matched by name, never by position: every trainable parameter of the loading
// model must be in the manifest with the same numel and global offset, and every parameter of the
// manifest in the model (errors name the parameter), and the optimizer kind must match (other
// hyperparameters may change; the loading engine's own are used, the manifest's are returned).
// For each unit of the loading engine and the flat range its rank keeps (Unit::kept_range:
// the owned shard, or the whole unit in stage 0), reshard.h maps each parameter's elements inside
// that range to the old unit's flat coordinates and cuts them at the old shard boundaries into
// pieces (old rank, offset in its file) → (offset in the kept range). Padding and alignment gaps
// are in no piece and stay zero. A rank reads only the old files its pieces need, each once, one
// at a time, so it holds its kept state plus one old file. World size, stage, alignment and the
// unit partition may all differ between the writing and the loading run; only the model and the
// optimizer kind must be the same. The engine's step counter and each unit optimizer's step count
// are restored; gradients are dropped (save between steps, after step()).
//
// Note [checkpoint extras]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// `extra` is per-rank state the engine does not know (the Python side stores torch's RNG states
// there); it is written into the rank's own file. Per-rank state of W ranks cannot be mapped onto
// W' ranks in general, so the rule is: the loading rank r gets the extra of old rank r when
// r < old world size (extra_rank = r), and none otherwise (extra_rank = -1). At the same world
// size every rank gets its own back. Rank-independent state goes in `shared` instead: rank 0
// writes it and every loading rank restores it in place into tensors of the same name, shape and
// dtype. The caller's `metadata` (free JSON, rank 0's) is stored in the manifest.
//
// Note [checkpoint faults]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// TEST ONLY. DPZERO_CHECKPOINT_FAULT=<phase> or <phase>:<rank> makes save() end the process
// with std::_Exit(kFaultExitCode) — a real crash: no destructors, no flush, no unwinding — when
// it reaches that phase (on any rank, or only on <rank>):
//   during_rank_file      half of the rank file written to its temporary name
//   after_rank_file       the rank file durable in the temporary step directory
//   before_manifest       rank 0, every rank file durable, manifest not written
//   before_commit_rename  rank 0, manifest durable, the directory not yet renamed
//   before_latest         rank 0, step directory committed, ROOT/latest not yet updated
// An unknown phase is an error, so a misspelt test cannot pass by never crashing.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "src/zero/state.h"

namespace dpzero::checkpoint {

// Named tensors, in order.
using TensorList = std::vector<std::pair<std::string, at::Tensor>>;

inline constexpr int kFaultExitCode = 86;  // Note [checkpoint faults]

struct SaveOptions {
  int64_t step = -1;          // the checkpoint's step; < 0: the engine's step counter
  int64_t keep_last = 0;      // > 0: after committing, keep this many committed steps at or below
                              // this step (this one included) and delete older ones
  std::string metadata_json = "{}";  // free JSON stored in the manifest (rank 0's)
};

// Collective (every rank of the engine's group calls it with the same root and options): writes
// the checkpoint by Note [checkpoint commit] and returns its step directory. extra: this rank's
// per-rank tensors; shared: rank-independent tensors, written from rank 0 (Note [checkpoint
// extras]). Throws on every rank if any rank fails, naming the failing rank, path and reason.
std::string save(zero::ZeroState& state, const std::string& root, const TensorList& extra,
                 const TensorList& shared, const SaveOptions& options);

struct LoadResult {
  std::string directory;        // the step directory loaded
  int64_t step = 0;
  int64_t engine_steps = 0;     // restored into the engine
  int64_t world_size = 0;       // of the run that wrote it
  int64_t stage = 0;            // of the run that wrote it
  std::string optimizer_json;   // {"kind": ..., "hyperparameters": {...}} of that run
  std::string metadata_json;    // the metadata save() was given
  TensorList extra;             // old rank extra_rank's extra (Note [checkpoint extras])
  int64_t extra_rank = -1;      // -1: no old rank r for this rank r
};

// Collective: loads `path` (a checkpoint root, through its `latest` as rank 0 reads it, or a step
// directory) into `state` by Note [checkpoint resharding], and copies the shared tensors into
// `shared` (matched by name; every name of either side must be in the other, with the same shape
// and dtype).
// Everything is read and checked before anything is changed, and a failure on any rank throws on
// every rank with the engine untouched.
LoadResult load(zero::ZeroState& state, const std::string& path, const TensorList& shared);

// The step directory `path` denotes: `path` itself if it holds manifest.json, else the directory
// ROOT/latest names. Throws naming the path when it is neither. No collective.
std::string resolve(const std::string& path);

}  // namespace dpzero::checkpoint
