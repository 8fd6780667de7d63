import sys, os, zipfile, glob, time, torch
D=os.path.dirname(os.path.abspath(__file__)); S=os.path.join(D,'site')
for w in glob.glob(os.path.join(D,'*.whl')): zipfile.ZipFile(w).extractall(S)
sys.path.insert(0,S)
import nvidia.nvcomp as nv
print('nvcomp',nv.__version__,nv.__cuda_version__,'torch',torch.__version__,torch.version.cuda, torch.cuda.get_device_name())
dev='cuda'; torch.manual_seed(0); N=8*1024*1024; K=19
def gen(kind):
    if kind=='gauss0.02': x=torch.randn(K*N,device=dev)*0.02
    elif kind=='lognorm_rows': x=(torch.randn(K*N//4096,4096,device=dev)*torch.exp(torch.randn(K*N//4096,1,device=dev)*0.5)*0.02).reshape(-1)
    else: x=torch.cat([torch.randn(K*N//2,device=dev)*0.005,torch.randn(K*N//2,device=dev)*0.08])
    return x.to(torch.bfloat16).view(K,N)
s=torch.cuda.Stream()
def timeit(fn,reps=3):
    fn(); s.synchronize(); a=torch.cuda.Event(enable_timing=True); b=torch.cuda.Event(enable_timing=True)
    a.record(s)
    for _ in range(reps): fn()
    b.record(s); b.synchronize(); return a.elapsed_time(b)/reps/1e3
for kind in ['lognorm_rows','two_tensors']:
    x=gen(kind); torch.cuda.synchronize()
    for algo,kw in [('ANS',dict(data_type='<f2')),('ANS',dict(data_type='|u1'))]:
      for ucs in ([1<<16,1<<20] if algo=='ANS' else [1<<16]):
        try:
            codec=nv.Codec(algorithm=algo,uncomp_chunk_size=ucs,cuda_stream=s.cuda_stream,**kw)
            with torch.cuda.stream(s):
                comps=[codec.encode(nv.as_array(x[i].view(torch.uint8),cuda_stream=s.cuda_stream)) for i in range(K)]
                s.synchronize(); tot=sum(c.buffer_size for c in comps)
                dcfg=codec.decompression_config(comps[0])
                out=torch.empty(K,2*N,dtype=torch.uint8,device=dev)
                outs=[nv.as_array(out[i],cuda_stream=s.cuda_stream) for i in range(K)]
                def dec():
                    for i in range(K): codec.decode(comps[i],out=outs[i],decompression_config=dcfg)
                t=timeit(dec); ok=torch.equal(out.view(torch.bfloat16),x)
                msg=''
                try:
                    bcomp=nv.as_arrays(list(comps),cuda_stream=s.cuda_stream); bout=nv.as_arrays([out[i] for i in range(K)],cuda_stream=s.cuda_stream)
                    bcfg=codec.decompression_config(bcomp)
                    out.zero_(); tb=timeit(lambda: codec.decode(bcomp,out=bout,decompression_config=bcfg)); msg=f" bexact={torch.equal(out.view(torch.bfloat16),x)}"+f' batched={K*2*N/tb/1e9:.0f}GB/s'
                except Exception as e: msg=f' batched-err={type(e).__name__}:{str(e)[:80]}'
            print(f'{kind:12s} {algo:8s} {str(kw):28s} chunk={ucs>>10}KiB ratio={tot/(K*2*N):.4f} decode={K*2*N/t/1e9:.0f}GB/s(out) exact={ok}{msg}',flush=True)
        except Exception as e: print(kind,algo,kw,ucs,'ERR',type(e).__name__,str(e)[:200],flush=True)
    # host round trip of one compressed chunk -> torch device buffer -> decode
    if kind=='gauss0.02':
        codec=nv.Codec(algorithm='ANS',data_type='<f2',cuda_stream=s.cuda_stream)
        with torch.cuda.stream(s):
            c=codec.encode(nv.as_array(x[0].view(torch.uint8),cuda_stream=s.cuda_stream)); s.synchronize()
            ct=torch.as_tensor(c,device=dev).view(torch.uint8).reshape(-1)[:c.buffer_size]
            host=ct.cpu().pin_memory(); buf=torch.empty(2*N,dtype=torch.uint8,device=dev)
            buf[:host.numel()].copy_(host,non_blocking=True)
            o=torch.empty(2*N,dtype=torch.uint8,device=dev)
            codec.decode(nv.as_array(buf[:host.numel()],cuda_stream=s.cuda_stream),out=nv.as_array(o,cuda_stream=s.cuda_stream)); s.synchronize()
            print('host round trip exact:',torch.equal(o.view(torch.bfloat16),x[0]),'bytes',host.numel(),flush=True)
# simple nibble scheme decode in Triton (top-15 exponents, code 15 = escape patched afterwards)
import triton, triton.language as tl
@triton.jit
def dec_nib(sm_ptr,code_ptr,lut_ptr,out_ptr,n,BLOCK:tl.constexpr):
    offs=tl.program_id(0).to(tl.int64)*BLOCK+tl.arange(0,BLOCK); m=offs<n
    sm=tl.load(sm_ptr+offs,mask=m,other=0).to(tl.int32)
    c=tl.load(code_ptr+offs//2,mask=m,other=0).to(tl.int32)
    nib=(c>>((offs%2)*4).to(tl.int32))&15
    e=tl.load(lut_ptr+nib)
    v=((sm&0x80)<<8)|(e<<7)|(sm&0x7f)
    tl.store(out_ptr+offs,v.to(tl.int16),mask=m)
x=gen('gauss0.02').reshape(-1); u=x.view(torch.int16).to(torch.int32)&0xffff
e=(u>>7)&0xff; sm=(((u>>8)&0x80)|(u&0x7f)).to(torch.uint8)
cnt=torch.bincount(e,minlength=256); top=torch.argsort(cnt,descending=True)[:15]
inv=torch.full((256,),15,dtype=torch.int32,device=dev); inv[top]=torch.arange(15,dtype=torch.int32,device=dev)
code=inv[e]; esc=(code==15).nonzero().squeeze(1); escv=x.view(torch.int16)[esc]
packed=(code[0::2]|(code[1::2]<<4)).to(torch.uint8)
lut=torch.zeros(16,dtype=torch.int32,device=dev); lut[:15]=top.to(torch.int32)
out=torch.empty(x.numel(),dtype=torch.int16,device=dev); n=x.numel()
for B in [1024,4096,8192]:
    def f():
        with torch.cuda.stream(s):
            dec_nib[(triton.cdiv(n,B),)](sm,packed,lut,out,n,BLOCK=B); out[esc]=escv
    t=timeit(f,5); print(f'triton nibble BLOCK={B}: {2*n/t/1e9:.0f} GB/s out, exact={torch.equal(out,x.view(torch.int16))}, esc={esc.numel()/n:.2e}, ratio={(n+n/2+esc.numel()*(8+2))/(2*n):.4f}',flush=True)
# reference: plain H2D pinned copy and D2D copy
h=torch.empty(2*N*K,dtype=torch.uint8).pin_memory(); d=torch.empty_like(h,device=dev)
with torch.cuda.stream(s):
    t=timeit(lambda: d.copy_(h,non_blocking=True)); print(f'H2D pinned {h.numel()/t/1e9:.1f} GB/s')
    t=timeit(lambda: out.copy_(x.view(torch.int16))); print(f'D2D copy {2*2*n/t/1e9:.0f} GB/s (r+w)')
