"""Single-thread CPU-time comparison of the tiled multi-query kernel (serial) with torch SDPA (1 thread) and the
numpy float32 matmul rate on the same thread: the figures of docs/kernel.md, "Measured against torch".
CPU time (time.process_time) instead of wall time, so that other processes on a shared machine do not enter.

    python -m benchmarks.multiquery_cpu        (needs torch; ~2 minutes)
"""
import os
os.environ["OPENBLAS_NUM_THREADS"]="1"; os.environ["OMP_NUM_THREADS"]="1"
import numpy as np, time, torch
torch.set_num_threads(1)
import torch.nn.functional as F
from decode.attention_plan import attend_unchecked as U
rng=np.random.default_rng(0)
def cpu(f, n=3):
    f(); ts=[]
    for _ in range(n):
        t=time.process_time(); f(); ts.append(time.process_time()-t)
    return np.median(ts)
A=np.random.rand(1024,1024).astype(np.float32)
mm = 2*1024**3/cpu(lambda: A@A)
print(f"numpy 1-thread matmul {mm/1e9:.0f} GF/s")
for dt in (np.float32, np.float16):
  for S,T in [(0,512),(0,2048),(4096,16),(4096,128),(4096,512)]:
    L=S+T; P=16; npg=-(-L//P)
    Kd = rng.standard_normal((L,8,128)).astype(dt); Vd = rng.standard_normal((L,8,128)).astype(dt)
    kp = np.zeros((npg*P,8,128),dt); kp[:L]=Kd; kp=kp.reshape(npg,P,8,128).transpose(0,2,1,3).copy()
    vp = np.zeros((npg*P,8,128),dt); vp[:L]=Vd; vp=vp.reshape(npg,P,8,128).transpose(0,2,1,3).copy()
    q = rng.standard_normal((T,32,128)).astype(np.float32)
    idx=np.arange(npg,dtype=np.int32); ip=np.array([0,npg],np.int64); qs=np.zeros(T,np.int32); qp=np.arange(S,L,dtype=np.int64)
    o=np.empty((T,32,128),np.float32)
    te = cpu(lambda: U(q,kp,vp,idx,ip,qs,qp,1/np.sqrt(128),0,o,mode=1))
    tdt = torch.float16 if dt==np.float16 else torch.float32
    Q=torch.from_numpy(q.transpose(1,0,2).copy()).to(tdt)[None]; K=torch.from_numpy(Kd.transpose(1,0,2).copy())[None]; V=torch.from_numpy(Vd.transpose(1,0,2).copy())[None]
    if S==0: f=lambda: F.scaled_dot_product_attention(Q,K,V,is_causal=True,enable_gqa=True)
    else:
        m=torch.from_numpy(np.arange(L)[None,:]<=qp[:,None]); f=lambda: F.scaled_dot_product_attention(Q,K,V,attn_mask=m,enable_gqa=True)
    tt = cpu(f)
    err = np.abs(f()[0].transpose(0,1).float().numpy()-o).max()
    flops=4*32*128*int((qp+1).sum())
    print(f"{np.dtype(dt).name} {S}+{T}: engine {te*1e3:.1f} ms cpu ({flops/te/1e9:.0f} GF/s, {flops/te/mm*100:.0f}% mm)  torch {tt*1e3:.1f} ms cpu  speed-up {tt/te:.2f}x  maxdiff {err:.1e}", flush=True)
