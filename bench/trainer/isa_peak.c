// The CPU's own ceiling for bf16 vs fp32 arithmetic on one core: back-to-back independent
// vfmadd231ps zmm (16 fp32 multiply-adds, 32 flops) against vdpbf16ps zmm (32 bf16 products
// summed pairwise into 16 fp32, 64 flops), 12 accumulators each so throughput, not latency,
// bounds the loop. Without AMX, no bf16 matmul can beat fp32 by more than their ratio.
// Built and run by bench/trainer/run.sh on CPUs with avx512_bf16:
//   cc -O2 -mavx512f -mavx512bf16 -o isa_peak bench/trainer/isa_peak.c && ./isa_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define ITERS 20000000L
int main(void){
  __m512 a0=_mm512_set1_ps(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m512 x=_mm512_set1_ps(1.0f), y=_mm512_set1_ps(1e-7f);
  double t=now();
  for(long n=0;n<ITERS;n++){
    a0=_mm512_fmadd_ps(x,y,a0);a1=_mm512_fmadd_ps(x,y,a1);a2=_mm512_fmadd_ps(x,y,a2);a3=_mm512_fmadd_ps(x,y,a3);
    a4=_mm512_fmadd_ps(x,y,a4);a5=_mm512_fmadd_ps(x,y,a5);a6=_mm512_fmadd_ps(x,y,a6);a7=_mm512_fmadd_ps(x,y,a7);
    a8=_mm512_fmadd_ps(x,y,a8);a9=_mm512_fmadd_ps(x,y,a9);a10=_mm512_fmadd_ps(x,y,a10);a11=_mm512_fmadd_ps(x,y,a11);
    __asm__ volatile("" : "+v"(x));
  }
  double f=now()-t;
  __m512 s=_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)),_mm512_add_ps(_mm512_add_ps(a4,a5),_mm512_add_ps(a6,a7)));
  s=_mm512_add_ps(s,_mm512_add_ps(_mm512_add_ps(a8,a9),_mm512_add_ps(a10,a11)));
  double fp32 = ITERS*12*32.0/f/1e9; float fp32_sum = _mm512_reduce_add_ps(s);
  __m512bh bx=(__m512bh)_mm512_set1_epi16(0x3f80), by=(__m512bh)_mm512_set1_epi16(0x3380);
  a0=a1=a2=a3=a4=a5=a6=a7=a8=a9=a10=a11=_mm512_set1_ps(0);
  t=now();
  for(long n=0;n<ITERS;n++){
    a0=_mm512_dpbf16_ps(a0,bx,by);a1=_mm512_dpbf16_ps(a1,bx,by);a2=_mm512_dpbf16_ps(a2,bx,by);a3=_mm512_dpbf16_ps(a3,bx,by);
    a4=_mm512_dpbf16_ps(a4,bx,by);a5=_mm512_dpbf16_ps(a5,bx,by);a6=_mm512_dpbf16_ps(a6,bx,by);a7=_mm512_dpbf16_ps(a7,bx,by);
    a8=_mm512_dpbf16_ps(a8,bx,by);a9=_mm512_dpbf16_ps(a9,bx,by);a10=_mm512_dpbf16_ps(a10,bx,by);a11=_mm512_dpbf16_ps(a11,bx,by);
    __asm__ volatile("" : "+v"(bx));
  }
  f=now()-t;
  s=_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)),_mm512_add_ps(_mm512_add_ps(a4,a5),_mm512_add_ps(a6,a7)));
  s=_mm512_add_ps(s,_mm512_add_ps(_mm512_add_ps(a8,a9),_mm512_add_ps(a10,a11)));
  double bf16 = ITERS*12*64.0/f/1e9;
  // The sums keep the loops from being optimised away.
  printf("{\"fp32_fma_gflops_per_core\": %.1f, \"bf16_dot_gflops_per_core\": %.1f, \"checksum\": %g}\n",
         fp32, bf16, fp32_sum + _mm512_reduce_add_ps(s));
}
