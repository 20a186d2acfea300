for i in 1 2 3 4; do for th in 1 2; do
  if [ $((i % 2)) = 1 ]; then order="/tmp/base /work/main"; else order="/work/main /tmp/base"; fi
  for t in $order; do (cd $t && PYTHONPATH=$t /work/main/.venv/bin/python /tmp/s16/ab2.py $th 262144 bfloat16,float16 2>&1 | grep -v Warn | sed "s#^#$t #"); done
done; done
