import numpy as np, torch, heapq
torch.manual_seed(0)
def huff_len(freqs):
    # average Huffman code length
    h=[(f,i) for i,f in enumerate(freqs) if f>0]; heapq.heapify(h); tot=0
    if len(h)==1: return 1.0
    while len(h)>1:
        a=heapq.heappop(h); b=heapq.heappop(h); tot+=a[0]+b[0]; heapq.heappush(h,(a[0]+b[0],-1))
    return tot/sum(freqs)
def analyze(w, name):
    u=w.view(torch.int16).numpy().view(np.uint16)
    e=((u>>7)&0xFF).astype(np.int64)
    cnt=np.bincount(e,minlength=256).astype(np.float64); n=cnt.sum(); p=cnt[cnt>0]/n
    H=-(p*np.log2(p)).sum(); order=np.argsort(-cnt)
    top15=cnt[order[:15]].sum()/n; top7=cnt[order[:7]].sum()/n; top3=cnt[order[:3]].sum()/n
    esc15=1-top15; esc7=1-top7
    # bytes per element (sign+mantissa byte = 1.0)
    huff=1+huff_len(cnt)/8
    A=1+0.5+esc15*5          # nibble + (uint32 pos + u8 exp) escape list
    A2=1+0.5+esc15*1         # nibble + in-order escape byte stream (prefix-sum decode)
    B=1+0.375+esc7*5         # 3-bit + positional escapes
    B2=1+0.375+esc7*1        # 3-bit + in-order escape byte stream
    print(f"{name:28s} distinct={int((cnt>0).sum()):3d} H={H:.3f}b  esc15={esc15:.2e} esc7={esc7:.3%} | "
          f"huff={huff/2:.3f} A(4b+pos)={A/2:.4f} A2={A2/2:.4f} B(3b+pos)={B/2:.4f} B2(3b+inorder)={B2/2:.4f}")
N=8*1024*1024  # one 16 MB chunk of bf16
for s in [0.01,0.02,0.05]:
    analyze((torch.randn(N)*s).to(torch.bfloat16), f"gauss std={s}")
# heavier tails / mixed scales (chunk spanning tensors with different std, per-row scale spread)
rows=torch.exp(torch.randn(N//3072,1)*0.5)*0.02
analyze((torch.randn(N//3072,3072)*rows).reshape(-1).to(torch.bfloat16),"gauss, lognormal row scale")
analyze((torch.distributions.StudentT(4.0).sample((N,))*0.015).to(torch.bfloat16),"student-t(4) 0.015")
analyze(torch.cat([torch.randn(N//2)*0.005, torch.randn(N//2)*0.08]).to(torch.bfloat16),"two tensors 0.005|0.08")
