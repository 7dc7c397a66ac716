// Quantized matrix-vector products over raw GGUF blocks, with llama.cpp's geometry
// (kernel_mul_mv_q4_K_f32 / kernel_mul_mv_q6_K_f32, ggml-metal mul_mv.metal), written from
// llama-cpp-facts.md A.2/A.3. Geometry: 2 SIMD groups per threadgroup, 2 rows per SIMD
// group (4 rows per threadgroup); one token per threadgroup column (grid z), so every token
// gets batch-1 bits. Every multiply that feeds an add is an explicit fma(), in the shape a
// fast-math compile of ggml's expressions contracts to, so no compiler is left a choice.
// dst[t, r] = sum_k W[r, k] * y[t, k]; W is [ROWS, K] in blocks of 256.

// ==== kernel: mul_mv_q4_K_f32
// inputs: w [ROWS, K/256*144] (uint8), y [T, K]; outputs: dst [T, ROWS]
// grid (ceil(ROWS/4)*32, 2, T), threadgroup (32, 2, 1)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint r0 = threadgroup_position_in_grid.x;
    const uint t = threadgroup_position_in_grid.z;
    const uint nb = K / 256;
    const uint row_bytes = nb * 144;
    const uint first_row = (r0 * 2 + sgitg) * 2;
    const ushort kmask1 = 0x3f3f, kmask2 = 0x0f0f, kmask3 = 0xc0c0;

    // lane = 8*ix + 4*iq + ir: ix picks the super-block phase, iq/ir the 32 values it reads
    const uint ix = tiisg / 8;
    const uint it = tiisg % 8;
    const uint iq = it / 4;
    const uint ir = it % 4;

    float yl[16];
    float yh[16];
    float sumf[2] = {0.0f, 0.0f};
    device const float* y4 = y + t * K + ix * 256 + 64 * iq + 8 * ir;

    for (uint ib = ix; ib < nb; ib += 4) {
        float4 sumy = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint i = 0; i < 8; ++i) {
            yl[i + 0] = y4[i + 0];   sumy[0] += yl[i + 0];
            yl[i + 8] = y4[i + 32];  sumy[1] += yl[i + 8];
            yh[i + 0] = y4[i + 128]; sumy[2] += yh[i + 0];
            yh[i + 8] = y4[i + 160]; sumy[3] += yh[i + 8];
        }
        for (uint row = 0; row < 2; ++row) {
            if (first_row + row >= ROWS) break;
            device const uchar* blk = w + (ulong)(first_row + row) * row_bytes + ib * 144;
            const float d = float(*(device const half*)(blk + 0));
            const float dmin = float(*(device const half*)(blk + 2));
            device const ushort* sc = (device const ushort*)(blk + 4) + iq;
            ushort sc16[4];
            sc16[0] = sc[0] & kmask1;
            sc16[1] = sc[2] & kmask1;
            sc16[2] = ((sc[4] >> 0) & kmask2) | ((sc[0] & kmask3) >> 2);
            sc16[3] = ((sc[4] >> 4) & kmask2) | ((sc[2] & kmask3) >> 2);
            thread const uchar* sc8 = (thread const uchar*)sc16;
            device const ushort* q1 = (device const ushort*)(blk + 16) + 16 * iq + 4 * ir;
            device const ushort* q2 = q1 + 32;

            // nibbles stay in place (x1, x256, x16, x4096): the power-of-two factors are undone
            // below exactly, so each lane keeps even and odd values in separate sums
            float4 acc1 = {0.0f, 0.0f, 0.0f, 0.0f};
            float4 acc2 = {0.0f, 0.0f, 0.0f, 0.0f};
            for (uint i = 0; i < 4; ++i) {
                acc1[0] = fma(yl[2 * i + 0], float(q1[i] & 0x000F), acc1[0]);
                acc1[1] = fma(yl[2 * i + 1], float(q1[i] & 0x0F00), acc1[1]);
                acc1[2] = fma(yl[2 * i + 8], float(q1[i] & 0x00F0), acc1[2]);
                acc1[3] = fma(yl[2 * i + 9], float(q1[i] & 0xF000), acc1[3]);
                acc2[0] = fma(yh[2 * i + 0], float(q2[i] & 0x000F), acc2[0]);
                acc2[1] = fma(yh[2 * i + 1], float(q2[i] & 0x0F00), acc2[1]);
                acc2[2] = fma(yh[2 * i + 8], float(q2[i] & 0x00F0), acc2[2]);
                acc2[3] = fma(yh[2 * i + 9], float(q2[i] & 0xF000), acc2[3]);
            }
            // d*((A0+A1)*s0 + (A2+A3)*s1/16 + (B0+B1)*s4 + (B2+B3)*s5/16) - dmin*(Y0*m0 + ...)
            const float a0 = fma(1.0f / 256.0f, acc1[1], acc1[0]);
            const float a1 = fma(1.0f / 256.0f, acc1[3], acc1[2]);
            const float b0 = fma(1.0f / 256.0f, acc2[1], acc2[0]);
            const float b1 = fma(1.0f / 256.0f, acc2[3], acc2[2]);
            float scaled = (a1 * float(sc8[1])) * (1.0f / 16.0f);
            scaled = fma(a0, float(sc8[0]), scaled);
            scaled = fma(b0, float(sc8[4]), scaled);
            scaled = fma(b1 * float(sc8[5]), 1.0f / 16.0f, scaled);
            float mins = sumy[1] * float(sc8[3]);
            mins = fma(sumy[0], float(sc8[2]), mins);
            mins = fma(sumy[2], float(sc8[6]), mins);
            mins = fma(sumy[3], float(sc8[7]), mins);
            sumf[row] += fma(d, scaled, -(dmin * mins));
        }
        y4 += 4 * 256;
    }
    for (uint row = 0; row < 2; ++row) {
        const float total = simd_sum(sumf[row]);
        if (tiisg == 0 && first_row + row < ROWS) dst[t * ROWS + first_row + row] = total;
    }

// ==== kernel: mul_mv_q6_K_f32
// inputs: w [ROWS, K/256*210] (uint8), y [T, K]; outputs: dst [T, ROWS]
// grid (ceil(ROWS/4)*32, 2, T), threadgroup (32, 2, 1)
    const uint tiisg = thread_position_in_threadgroup.x;
    const uint sgitg = thread_position_in_threadgroup.y;
    const uint r0 = threadgroup_position_in_grid.x;
    const uint t = threadgroup_position_in_grid.z;
    const uint nb = K / 256;
    const uint row_bytes = nb * 210;
    const uint first_row = (r0 * 2 + sgitg) * 2;

    // lane = 2*tid + ix: ix picks even/odd super-blocks; tid = 8*ip + il the 16 values read
    const uint tid = tiisg / 2;
    const uint ix = tiisg % 2;
    const uint ip = tid / 8;
    const uint il = tid % 8;
    const uint l0 = 4 * il;
    const uint is = 8 * ip + l0 / 16;
    const uint y_offset = 128 * ip + l0;
    const uint q_offset_l = 64 * ip + l0;
    const uint q_offset_h = 32 * ip + l0;

    float yl[16];
    float sumf[2] = {0.0f, 0.0f};
    for (uint i = ix; i < nb; i += 2) {
        device const float* yy = y + t * K + i * 256 + y_offset;
        for (uint l = 0; l < 4; ++l) {
            yl[4 * l + 0] = yy[l + 0];
            yl[4 * l + 1] = yy[l + 32];
            yl[4 * l + 2] = yy[l + 64];
            yl[4 * l + 3] = yy[l + 96];
        }
        for (uint row = 0; row < 2; ++row) {
            if (first_row + row >= ROWS) break;
            device const uchar* blk = w + (ulong)(first_row + row) * row_bytes + i * 210;
            device const uchar* q1 = blk + q_offset_l;
            device const uchar* q2 = q1 + 32;
            device const uchar* qh = blk + 128 + q_offset_h;
            device const int8_t* sc = (device const int8_t*)(blk + 192) + is;
            const float d = float(*(device const half*)(blk + 208));

            float4 sums = {0.0f, 0.0f, 0.0f, 0.0f};
            for (uint l = 0; l < 4; ++l) {
                sums[0] = fma(yl[4 * l + 0], float(int((q1[l] & 0xF) | ((qh[l] & 0x03) << 4)) - 32), sums[0]);
                sums[1] = fma(yl[4 * l + 1], float(int((q2[l] & 0xF) | ((qh[l] & 0x0C) << 2)) - 32), sums[1]);
                sums[2] = fma(yl[4 * l + 2], float(int((q1[l] >> 4) | ((qh[l] & 0x30) << 0)) - 32), sums[2]);
                sums[3] = fma(yl[4 * l + 3], float(int((q2[l] >> 4) | ((qh[l] & 0xC0) >> 2)) - 32), sums[3]);
            }
            // sumf += d * (S0*sc[0] + S1*sc[2] + S2*sc[4] + S3*sc[6])
            float scaled = sums[1] * float(sc[2]);
            scaled = fma(sums[0], float(sc[0]), scaled);
            scaled = fma(sums[2], float(sc[4]), scaled);
            scaled = fma(sums[3], float(sc[6]), scaled);
            sumf[row] = fma(d, scaled, sumf[row]);
        }
    }
    for (uint row = 0; row < 2; ++row) {
        const float total = simd_sum(sumf[row]);
        if (tiisg == 0 && first_row + row < ROWS) dst[t * ROWS + first_row + row] = total;
    }
