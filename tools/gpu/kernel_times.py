"""Sums an `ncu --metrics gpu__time_duration.sum[,dram__bytes_read.sum] --csv` report per kernel
(tools/gpu/profile-bench.sh): launches, time, and where the report has them DRAM bytes read and the
bandwidth they make."""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
data = []
for r in rows:
    if 'Kernel Name' in r:
        hdr = r; continue
    if hdr and len(r) == len(hdr):
        data.append(dict(zip(hdr, r)))
SCALE = {'nsecond': 1, 'usecond': 1e3, 'msecond': 1e6, 'second': 1e9,
         'byte': 1, 'Kbyte': 1e3, 'Mbyte': 1e6, 'Gbyte': 1e9}
tot = collections.defaultdict(float); cnt = collections.Counter(); byt = collections.defaultdict(float)
for d in data:
    name = d['Kernel Name'].split('(')[0]
    v = float(d['Metric Value'].replace(',', '')) * SCALE.get(d.get('Metric Unit', ''), 1)
    if d.get('Metric Name') == 'gpu__time_duration.sum':
        tot[name] += v; cnt[name] += 1
    elif d.get('Metric Name') == 'dram__bytes_read.sum':
        byt[name] += v
if '--launches' in sys.argv:
    # Every launch in order: id, kernel, grid, block, time, DRAM bytes read.
    per = collections.OrderedDict()
    for d in data:
        key = d.get('ID', str(len(per)))
        e = per.setdefault(key, {'name': d['Kernel Name'].split('(')[0], 'grid': d.get('Grid Size', ''),
                                 'block': d.get('Block Size', ''), 't': 0.0, 'b': 0.0})
        v = float(d['Metric Value'].replace(',', '')) * SCALE.get(d.get('Metric Unit', ''), 1)
        if d.get('Metric Name') == 'gpu__time_duration.sum':
            e['t'] = v
        elif d.get('Metric Name') == 'dram__bytes_read.sum':
            e['b'] = v
    for key, e in per.items():
        print(f"{key:>6} {e['name']:28s} {e['grid']:>16s} {e['block']:>14s} {e['t']/1e3:9.2f} us {e['b']/1e6:9.3f} MB")
    sys.exit(0)
n = sum(cnt.values()); s = sum(tot.values())
print(f"{n} kernels, {s/1e6:.3f} ms GPU time in total, {sum(byt.values())/1e6:.1f} MB read from DRAM")
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    line = f"{k:32s} {cnt[k]:6d} launches {v/1e3:10.1f} us  {v/cnt[k]/1e3:8.2f} us/launch"
    if k in byt:
        line += f"  {byt[k]/cnt[k]/1e6:8.2f} MB/launch  {byt[k]/v:7.0f} GB/s"
    print(line)
