for i in 1 2; do
  if [ $i = 1 ]; then order="/tmp/base /work/main"; else order="/work/main /tmp/base"; fi
  for t in $order; do echo "== $t"; (cd $t && PYTHONPATH=$t /work/main/.venv/bin/python benchmarks/batching.py --cpu-kernels fused --kernel-dtypes bfloat16 --service-dtypes "" --no-wait --repeat 3 --out /tmp/s16/batch-$(basename $t)-$i.md 2>&1 | grep -v Warn | tail -5); done
done
