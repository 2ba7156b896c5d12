import json,glob,statistics as st
import sys; D=sys.argv[1] if len(sys.argv)>1 else '/tmp/bench52'
res={}
for f in sorted(glob.glob(D+'/micro_*.json')):
    tree=f.split('/')[-1].split('_')[1]
    for r in json.load(open(f))['rows']:
        k=(r['label'], r['density'])
        res.setdefault(k,{}).setdefault(tree,[]).append((r['median_s']*1e3, (r.get('worker_cpu_s_per_op') or 0)*1e3))
for k in sorted(res, key=str):
    o,n=res[k].get('old',[]),res[k].get('new',[])
    mo,mn=st.median(x[0] for x in o), st.median(x[0] for x in n)
    co,cn=st.median(x[1] for x in o), st.median(x[1] for x in n)
    print(f"{k[0]:>14} d={k[1]:<5} old {[round(x[0],1) for x in o]} med {mo:.1f} | new {[round(x[0],1) for x in n]} med {mn:.1f} | new/old {mn/mo:.2f} | cpu/op old {co:.1f} new {cn:.1f}")
