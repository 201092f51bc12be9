"""Sums an `ncu --metrics gpu__time_duration.sum --csv` report per kernel (tools/gpu/profile.sh)."""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
data = []
for r in rows:
    if 'Kernel Name' in r:
        hdr = r; continue
    if hdr and len(r) == len(hdr):
        data.append(dict(zip(hdr, r)))
tot = collections.defaultdict(float); cnt = collections.Counter()
for d in data:
    if d.get('Metric Name') != 'gpu__time_duration.sum': continue
    v = float(d['Metric Value'].replace(',', ''))
    unit = d.get('Metric Unit', 'nsecond')
    ns = v * {'nsecond': 1, 'usecond': 1e3, 'msecond': 1e6, 'second': 1e9}.get(unit, 1)
    tot[d['Kernel Name'].split('(')[0]] += ns; cnt[d['Kernel Name'].split('(')[0]] += 1
n = sum(cnt.values()); s = sum(tot.values())
print(f"{n} kernels, {s/1e6:.3f} ms GPU time in total")
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{k:40s} {cnt[k]:6d} launches {v/1e3:10.1f} us  {v/cnt[k]/1e3:8.2f} us/launch")
