// The tensor-core fragment and asynchronous-copy instructions of
// csrc/cuda/mma_primitives.cuh for the SIMT harness (simt.h), per lane, with the
// fragment layouts of the PTX ISA (groupID = lane / 4, threadID_in_group = lane % 4):
//
//   ldmatrix(regs, count, trans, row)   ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16:
//       lanes 8i .. 8i + 7 pass the addresses of the eight 16-byte rows of matrix i; register i
//       of lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i (.trans:
//       column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1), the lower column (row) in the low half.
//   mma_m16n8k16(d, a, b, c, bf16)      mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.f32:
//       d = a · b + c for A [16, 16], B [16, 8], C and D [16, 8] in fp32; with g = groupID and
//       t = threadID_in_group, a lane holds A (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
//       (g+8, 2t+8..) in a[0..3], B (2t..2t+1, g), (2t+8..2t+9, g) in b[0..1] and C/D (g, 2t),
//       (g, 2t+1), (g+8, 2t), (g+8, 2t+1) in c/d[0..3]. Products are exact in fp32 (16-bit
//       operands), the sum runs in fp32 in k order after c.
//   cp_async(dst, src, bytes, src_bytes) cp.async.{ca,cg}.shared.global (4, 8 or 16 bytes, the
//       bytes past src_bytes zero-filled), cp_async_commit() (cp.async.commit_group),
//       cp_async_wait(n) (cp.async.wait_group n): a copy lands when a wait retires its group,
//       the latest moment the GPU allows, so reading the destination earlier sees the old
//       bytes (the poisoned shared memory at first); with set_cp_async_eager(true), when it is
//       issued, the earliest moment, so a copy into a buffer still being read shows up too.
//
// ldmatrix and mma are warp-collective (simt::warp_collective): every lane must execute the
// same one, or the block deadlocks (reported). Misuse the GPU would fault on or leave
// undefined — a row address outside the dynamic shared memory or not 16-byte aligned, lanes
// disagreeing on the count or .trans, a cp.async destination outside shared memory or a
// misaligned address, a thread exiting with copies it never waited for — is reported and
// aborts, like the harness's other misuse checks.
#pragma once

#include <cstdint>

#include "simt.h"

namespace simt {

void ldmatrix(uint32_t* regs, unsigned count, bool trans, const void* row);
void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c, bool bf16);
void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes);
void cp_async_commit();
void cp_async_wait(unsigned pending_groups);
// Whether copies land when issued (true) or when waited for (false, the default); returns the previous setting.
bool set_cp_async_eager(bool eager);

}  // namespace simt
