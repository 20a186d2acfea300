for i in 1 2 3 4 5; do for t in /tmp/base /work/main; do TREE=$t /work/main/.venv/bin/python /tmp/s16/incache.py | sed "s#^#$t #"; done; done
