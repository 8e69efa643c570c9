# $1: out dir. One fresh process per case (JAX's trace caches make locations depend on earlier cases).
cd /work/wt-ci13
for c in gdpa_dense gdpa_jagged gdpa_f32out gdpa_stream fna_chain_jagged fna_fused_dense nm_77x256x128_layer_b nm_64x512x256_rms nm_40x320x192_layer_b nm_40x320x192_layer_f32 nm_24x320x512_rms_b nm_24x576x128_rms mn_res layer_norm rms_norm; do
  PYTHONPATH=$PWD PJRT_NPROC=8 /work/main/.venv/bin/python .devcarry/ci13_ab/export_check.py $1 --no-run $c 2>&1 | tail -1
done
