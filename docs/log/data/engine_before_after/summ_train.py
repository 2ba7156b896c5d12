import json,glob,statistics as st
import sys; D=sys.argv[1] if len(sys.argv)>1 else '/tmp/bench52'
res={}
for f in sorted(glob.glob(D+'/train_*.json')):
    tree=f.split('/')[-1].split('_')[1]
    for r in json.load(open(f))['rows']:
        res.setdefault((r['model'],r['hook'],tree),[]).append((r['median_step_s']*1e3, r['cpu_ms_per_step'], r['mb_per_step'], r['loadavg_1min']))
for k in sorted(res):
    v=res[k]
    print(k, "step ms per run:", [round(x[0],1) for x in v], "median %.1f"%st.median(x[0] for x in v), "cpu ms", [round(x[1],1) for x in v], "MB", [round(x[2],2) for x in v], "load", [x[3] for x in v])
