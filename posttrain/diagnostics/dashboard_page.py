"""The runs, run and compare pages of ``posttrain view`` (vanilla JS + plotly.js served locally, no CDN).

The pages read the JSON endpoints of :mod:`posttrain.diagnostics.viewer_server`: the runs page every
5 s, the run page's curves every 2 s with an ``after=<last step>`` cursor, appending the new points
without a reload (its status every 5 s; its symptoms after new points, at most every 4 s, else every
15 s); the compare page once. ``window.__posttrain`` exposes ``ready`` (first render done), ``polls``
and ``renders`` for the browser tests.
"""

from __future__ import annotations

_STYLE = r"""
body{font-family:sans-serif;margin:0;font-size:13px;color:#222}
header{background:#223;color:#eee;padding:6px 12px;display:flex;gap:10px;align-items:center;flex-wrap:wrap}
header a{color:#9cf}.right{margin-left:auto;display:flex;gap:8px;align-items:center}
.badge{padding:1px 7px;border-radius:8px;font-size:12px;color:#fff}
.running{background:#1769c4}.finished{background:#2a8a3a}.failed{background:#b3261e}.stopped{
  background:#b76e00}
#msg{color:#a00;padding:0 12px;white-space:pre-wrap}#note{color:#666;padding:0 12px}
table{border-collapse:collapse;margin:10px 12px}td,th{border-bottom:1px solid #ddd;padding:4px 8px;
  text-align:left;
vertical-align:top}th{background:#f2f2f4}.axes{color:#555;font-size:11px;max-width:520px}
"""

RUNS_PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain view: runs</title><link rel="icon" href="data:,">
<style>""" + _STYLE + r"""</style></head><body>
<header><b>posttrain view</b> <span id="root"></span><span class="right"><button id="compare">
  compare selected</button>
 <span id="updated"></span></span></header>
<div id="msg"></div>
<table id="runs"><thead><tr><th></th><th>run</th><th>status</th><th>recipe</th><th>trainer</th><th>step</th>
<th>last held-out (95% interval)</th><th>recipe axes</th></tr></thead><tbody></tbody></table>
<script>
window.__posttrain={ready:false,polls:0};
const $=id=>document.getElementById(id);
function fmt(v,d=3){return v===null||v===undefined?"-":(typeof v==="number"?v.toFixed(d):String(v))}
function heldout(h){if(!h)return "-";let s=h.key+" "+fmt(h.value);
  if(h.low!==null&&h.high!==null)s+=" ["+fmt(h.low)+", "+fmt(h.high)+"]";return s+" @ step "+h.step+
  (h.n?" (n="+h.n+")":"")}
function cell(tr,text,cls){const td=document.createElement("td");td.textContent=text;if(cls)td.className=cls;
  tr.appendChild(td);return td}
async function load(){try{const r=await fetch("/api/runs");const j=await r.json();
    if(!r.ok){$("msg").textContent=j.error;return}$("msg").textContent="";$("root").textContent=j.root;
    const body=document.querySelector("#runs tbody");
    const picked=new Set([...document.querySelectorAll(".pick:checked")].map(e=>e.value));body.innerHTML="";
    for(const run of j.runs){const tr=document.createElement("tr");tr.className="run";tr.dataset.id=run.id;
      const box=document.createElement("input");box.type="checkbox";box.className="pick";box.value=run.id;
      box.checked=picked.has(run.id);cell(tr,"").appendChild(box);
      const a=document.createElement("a");a.href="/run/"+encodeURIComponent(run.id)+"/";
  a.textContent=run.id==="@"?run.path:run.id;
      const td=cell(tr,"");td.appendChild(a);
      const st=cell(tr,"");const b=document.createElement("span");b.className="badge status "+run.status;
  b.textContent=run.status;
      b.title=run.status_why;st.appendChild(b);
      cell(tr,run.name||"-");cell(tr,run.trainer||"-");
      cell(tr,fmt(run.last_step,0)+" / "+fmt(run.steps,0));cell(tr,heldout(run.heldout),"heldout");
      cell(tr,Object.entries(run.axes||{}).map(([k,v])=>k+": "+v).join("\n"),
  "axes").style.whiteSpace="pre-wrap";
      body.appendChild(tr)}
    $("updated").textContent="updated "+new Date().toLocaleTimeString();window.__posttrain.ready=true;
  }catch(e){$("msg").textContent="cannot reach the posttrain view server: "+e.message}
  finally{window.__posttrain.polls++;setTimeout(load,5000)}}
$("compare").onclick=()=>{
  const ids=[...document.querySelectorAll(".pick:checked")].map(e=>encodeURIComponent(e.value));
  if(ids.length<2){$("msg").textContent="tick two or more runs to compare";return}
  location.href="/compare/?runs="+ids.join(",")};
load();
</script></body></html>
"""

RUN_PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain view: run</title><link rel="icon" href="data:,">
<style>""" + _STYLE + r"""
#panels{display:grid;grid-template-columns:1fr 1fr;gap:4px;padding:4px 8px}
.plot{height:270px;border:1px solid #e4e4e8}
#symptoms{padding:4px 12px}.symptom{color:#8a1c1c;margin:2px 0}.symptom b{cursor:pointer}
.symptom .check{color:#555}
#drawer{position:fixed;top:40px;right:0;width:46%;bottom:0;background:#fff;border-left:2px solid #223;
  overflow:auto;
padding:8px 12px;z-index:10;box-shadow:-4px 0 8px rgba(0,0,0,.15)}
#drawer pre{font-size:12px;background:#f6f6f8;padding:6px}
#other{padding:4px 8px}
</style>
<script src="/static/plotly.min.js"></script></head><body>
<header><a href="/">runs</a> <b id="name"></b> <span id="status" class="badge"></span> <span id="stepinfo">
  </span>
 <span id="headline"></span>
 <span class="right">x axis <select id="xaxis"><option value="step">step</option>
 <option value="tokens">generated tokens</option><option value="wall">wall time (s)</option></select>
 <button id="btn-config">config</button> <button id="btn-ckpt">checkpoints</button>
 <a id="traj-link" href="traj/">trajectories</a> <span id="live"></span></span></header>
<div id="msg"></div><div id="note"></div>
<div id="drawer" hidden><button id="drawer-close">close</button><div id="drawer-body"></div></div>
<div id="symptoms"></div>
<div id="panels"></div>
<div id="other">other metric <select id="other-key"><option value="">-</option></select>
 <div id="plot-other" class="plot" hidden></div></div>
<script>
window.__posttrain={ready:false,polls:0,renders:0};
const $=id=>document.getElementById(id);
const COLORS=["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#e377c2","#17becf"];
const XLABEL={step:"step",tokens:"generated tokens",wall:"wall time (s)"};
const S={gen:null,last:null,panels:[],series:{},bands:{},rejected:[],axes:{},other:"",hasLedger:false};
let symptoms=[],xaxis="step",lastSide=0,lastSum=0;
function fmt(v,d=3){return v===null||v===undefined?"-":(typeof v==="number"?v.toFixed(d):String(v))}
function rgba(hex,a){const n=parseInt(hex.slice(1),16);return "rgba("+(n>>16)+","+((n>>8)&255)+","+(n&255)+
  ","+a+")"}
async function api(path){const r=await fetch(path);const j=await r.json();
  if(!r.ok){$("msg").textContent=j.error;throw new Error(j.error)}return j}
function merge(j){
  if(j.reset){S.series={};S.bands={};S.rejected=[]}
  S.rejected.push(...j.rejected);
  for(const [k,s] of Object.entries(j.series)){const o=S.series[k];
    if(!o||j.reset){S.series[k]=s;continue}for(const f of ["step","tokens","wall","y"])o[f].push(...s[f])}
  for(const [k,b] of Object.entries(j.bands)){const o=S.bands[k];
    if(!o||j.reset){S.bands[k]=b;continue}for(const f of ["step","tokens","wall","low",
  "high"])o[f].push(...b[f])}
  const newPanels=JSON.stringify(j.panels)!==JSON.stringify(S.panels);
  S.gen=j.gen;S.last=j.last_step;S.panels=j.panels;S.axes=j.axes;S.hasLedger=j.has_ledger;
  $("stepinfo").textContent=j.n_steps+" logged steps, last "+fmt(j.last_step,0);
  $("note").textContent=(j.n_steps?"":"no complete line in metrics.jsonl yet: the curves appear with the "+
    "first step. ")+
    (j.skipped_lines?j.skipped_lines+" line(s) of metrics.jsonl could not be read and were skipped":"");
  $("traj-link").hidden=!j.has_ledger;
  for(const o of $("xaxis").options)o.disabled=!j.axes[o.value];
  const sel=$("other-key"),keys=j.other_keys.join(",");
  if(sel.dataset.keys!==keys){sel.dataset.keys=keys;const cur=sel.value;
  sel.innerHTML="<option value=''>-</option>";
    for(const k of j.other_keys){const o=document.createElement("option");o.value=k;o.textContent=k;
  sel.appendChild(o)}sel.value=cur}
  return newPanels}
function symptomShapes(p){const shapes=[],ann=[];
  for(const s of symptoms){if(!s.flagged||s.step===null||!p.symptoms.includes(s.name))continue;
    const x=s[xaxis];shapes.push({type:"line",xref:"x",yref:"paper",x0:x,x1:x,y0:0,y1:1,line:{color:"#b3261e",
  dash:"dot",width:2}});
    ann.push({x:x,xref:"x",yref:"paper",y:1,yanchor:"bottom",text:"&#9888; "+s.name+" (step "+s.step+")",
  showarrow:false,
      font:{color:"#b3261e",size:11},hovertext:s.evidence+"<br>"+s.check,bgcolor:"rgba(255,255,255,0.8)"})}
  return [shapes,ann]}
function tracesOf(p){const out=[];let i=0;const xa=p.xfixed?"step":xaxis;
  for(const t of p.traces){const s=S.series[t.key];if(!s)continue;const c=COLORS[i++%COLORS.length];
    const b=S.bands[t.key],yaxis=t.axis==="y2"?"y2":"y";
    if(b)out.push({x:b[xa].concat([...b[xa]].reverse()),y:b.high.concat([...b.low].reverse()),type:"scatter",
      mode:"lines",fill:"toself",fillcolor:rgba(c,0.15),line:{width:0},hoverinfo:"skip",showlegend:false,
      name:t.label+" 95% band",yaxis:yaxis});
    out.push({x:s[xa],y:s.y,customdata:p.xfixed?undefined:s.step,name:t.label,type:"scatter",
      mode:s.y.length>120?"lines":"lines+markers",line:{color:c,width:1.5},marker:{size:4},yaxis:yaxis,
      meta:t.key,hovertemplate:t.label+"<br>"+(p.xfixed?p.xfixed+" %{x}":"step %{customdata}")+
      "<br>%{y:.4g}<extra></extra>"})}
  // revisions the held-out judgement rejected, on the greedy held-out curve
  if(p.id==="heldout"&&S.rejected.length)out.push({x:S.rejected.map(r=>r[xaxis]),y:S.rejected.map(r=>r.y),
    customdata:S.rejected.map(r=>r.step),text:S.rejected.map(r=>r.reason),type:"scatter",mode:"markers",
    name:"rejected revision",meta:"rejected",marker:{symbol:"x",size:10,color:"#b3261e"},
    hovertemplate:"rejected at step %{customdata}<br>%{y:.4g}<br>%{text}<extra></extra>"});
  return out}
function layoutOf(p){const [shapes,ann]=symptomShapes(p);const y2=p.traces.some(t=>t.axis==="y2");
  const l={title:{text:p.title,font:{size:13},x:0.02},margin:{l:55,r:y2?65:15,t:34,b:38},hovermode:"closest",
    xaxis:{title:{text:p.xfixed||XLABEL[xaxis],font:{size:11}}},yaxis:{type:p.log?"log":"linear"},
  shapes:shapes,annotations:ann,
    legend:{font:{size:10}},uirevision:xaxis};
  if(y2){l.yaxis2={overlaying:"y",side:"right",showgrid:false,rangemode:"tozero"};l.legend.x=1.12;
  l.legend.xanchor="left"}
  return l}
function plot(div,traces,layout){return Plotly.react(div,traces,layout,{displaylogo:false,responsive:true})}
function clickable(div){if(div.dataset.click)return;div.dataset.click="1";
  div.on("plotly_click",ev=>{const pt=ev.points&&ev.points[0];
    if(pt&&pt.customdata!==undefined&&S.hasLedger)location.href="traj/?step="+pt.customdata})}
async function render(){const box=$("panels");
  const ids=S.panels.map(p=>"plot-"+p.id);
  for(const el of [...box.children])if(!ids.includes(el.id))el.remove();
  const jobs=[];
  S.panels.forEach((p,i)=>{let div=$("plot-"+p.id);
    if(!div){div=document.createElement("div");div.id="plot-"+p.id;div.className="plot panel"}
    if(box.children[i]!==div)box.insertBefore(div,box.children[i]||null);
    jobs.push(plot(div,tracesOf(p),layoutOf(p)).then(()=>clickable(div)))});
  if(S.other&&S.series[S.other]){const p={id:"other",title:S.other,traces:[{key:S.other,label:S.other,
  axis:"y"}],symptoms:[]};
    $("plot-other").hidden=false;jobs.push(plot($("plot-other"),tracesOf(p),
  layoutOf(p)).then(()=>clickable($("plot-other"))))}
  await Promise.all(jobs);window.__posttrain.renders++}
async function loadSymptoms(){try{const j=await api("api/symptoms");symptoms=j.symptoms;
  const box=$("symptoms");box.innerHTML="";
    for(const s of symptoms.filter(s=>s.flagged)){const d=document.createElement("div");d.className="symptom";
      d.dataset.name=s.name;d.dataset.step=s.step;
      d.innerHTML="&#9888; <b></b> <span class='ev'></span><br><span class='check'></span>";
      d.querySelector("b").textContent=s.name+(s.step!==null?" (from step "+s.step+")":"");
      d.querySelector(".ev").textContent=s.evidence;d.querySelector(".check").textContent="remedy: "+s.check;
  box.appendChild(d)}
    if(!symptoms.some(s=>s.flagged)){
  box.innerHTML="<span style='color:#2a8a3a'>no failure symptom flagged</span>"}
    await render()}catch(e){}}
async function loadSummary(){try{const j=await api("api/summary");$("name").textContent=(j.name||"")+"  "+
  j.path;
    document.title="posttrain view: "+(j.name||j.id);
    const st=$("status");st.textContent=j.status;st.className="badge "+j.status;st.title=j.status_why;
    const h=j.heldout;$("headline").textContent=h?h.key+" "+fmt(h.value)+(h.low!==null?" ["+fmt(h.low)+", "+
  fmt(h.high)+"]":"")+
      " @ step "+h.step:""}catch(e){}}
async function poll(){let grew=false;
  try{const q=new URLSearchParams();if(S.last!==null&&S.gen!==null){q.set("after",S.last);q.set("gen",S.gen)}
    if(S.other)q.set("keys",S.other);
    const before=S.last,j=await api("api/curves?"+q);const changed=merge(j);
    grew=j.reset||j.last_step!==before;
    if(grew||changed)await render();
    $("msg").textContent="";$("live").textContent="live, polled "+new Date().toLocaleTimeString();
    window.__posttrain.ready=true;
  }catch(e){$("live").textContent="not reachable: "+e.message}
  finally{window.__posttrain.polls++;
    const now=Date.now();if(grew&&now-lastSide>4000||now-lastSide>15000){lastSide=now;lastSum=now;
  loadSummary();loadSymptoms()}
    else if(now-lastSum>5000){lastSum=now;loadSummary()}
    setTimeout(poll,2000)}}
// api() shows a failed request in #msg: no uncaught rejection on top of it
const quiet=p=>p.catch(()=>{});
function drawer(html){$("drawer-body").innerHTML=html;const d=$("drawer");
  d.style.top=document.querySelector("header").getBoundingClientRect().bottom+"px";d.hidden=false}
function esc(s){const d=document.createElement("div");d.textContent=s;return d.innerHTML}
$("drawer-close").onclick=()=>{$("drawer").hidden=true};
$("btn-config").onclick=()=>quiet((async()=>{const j=await api("api/config");
  drawer("<h3>config.yaml</h3><div>"+esc(j.path)+"</div><table id='axes-table'>"+
  Object.entries(j.axes).map(([k,v])=>
    "<tr><th>"+esc(k)+"</th><td>"+esc(v)+"</td></tr>").join("")+"</table>"+
    (j.replaced.length?"<div>kept by a forced resume: "+esc(j.replaced.join(", "))+"</div>":"")+
    "<pre id='config-text'>"+esc(j.text===null?"(no config.yaml)":j.text)+"</pre>")})());
$("btn-ckpt").onclick=()=>quiet((async()=>{const j=await api("api/checkpoints");
  let h="<h3>checkpoints</h3><table id='ckpt-table'><tr><th>step</th><th>complete</th><th>revision</th>"+
    "<th></th></tr>";
  for(const c of j.checkpoints)h+="<tr class='ckpt'><td>"+c.step+"</td><td>"+(c.complete?"yes":"no (torn)")+
  "</td><td>"+
    esc(c.decision||"-")+"</td><td>"+(c.promoted_latest?"latest promoted":"")+"</td></tr>";
  h+="</table><h3>promote / reject decisions</h3><table>";
  for(const d of j.decisions)h+="<tr><td>step "+d.step+"</td><td>"+esc(d.decision)+"</td><td>"+fmt(d.heldout)+
  "</td><td>"+
    esc(d.reason)+"</td></tr>";
  drawer(h+"</table>"+(j.checkpoints.length?"":"<div>no checkpoint yet</div>"))})());
$("xaxis").onchange=e=>{xaxis=e.target.value;quiet(render())};
$("other-key").onchange=e=>{S.other=e.target.value;if(!S.other){$("plot-other").hidden=true;return}
  quiet(api("api/curves?keys="+encodeURIComponent(S.other)).then(j=>{merge(j);return render()}))};
if(typeof Plotly==="undefined"){
  $("msg").textContent="plotly.js did not load: install the plot extra (pip install 'posttrain[plot]')"}
else{loadSummary();poll()}
</script></body></html>
"""

COMPARE_PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain view: compare</title><link rel="icon" href="data:,">
<style>""" + _STYLE + r"""
#panels{display:grid;grid-template-columns:1fr 1fr;gap:4px;padding:4px 8px}
.plot{height:290px;border:1px solid #e4e4e8}
#blocking{color:#a00;padding:0 12px}
</style>
<script src="/static/plotly.min.js"></script></head><body>
<header><a href="/">runs</a> <b>compare</b> <span id="what"></span>
 <span class="right">x axis <select id="xaxis"><option value="tokens">generated tokens</option>
 <option value="step">step</option><option value="wall">wall time (s)</option></select></span></header>
<div id="msg"></div><div id="blocking"></div>
<table id="cmp"><thead><tr><th>recipe (runs)</th><th>generated tokens</th><th>held-out at the budget</th>
<th>difference from the first (paired bootstrap 95%; t over seeds)</th></tr></thead><tbody></tbody></table>
<div id="diffkeys" class="axes" style="padding:0 12px"></div>
<div id="panels"></div>
<script>
window.__posttrain={ready:false};
const $=id=>document.getElementById(id);
const COLORS=["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#e377c2","#17becf"];
const XLABEL={step:"step",tokens:"generated tokens",wall:"wall time (s)"};
const PANELS=[["heldout","held-out accuracy (greedy)","heldout/accuracy"],
  ["heldout_sampled","held-out accuracy (sampled)","heldout_sampled/accuracy"],
  ["reward","training reward","reward/mean"],["entropy","policy entropy","entropy"],
  ["kl","KL (learner)","kl"],
  ["length","response length","length/mean"],["pairs","held-out pair accuracy","heldout/pair_accuracy"]];
const ids=(new URLSearchParams(location.search).get("runs")||"").split(",").filter(Boolean);
let xaxis="tokens",doc=null;const curves={};
function fmt(v,d=3){return v===null||v===undefined?"-":(typeof v==="number"?v.toFixed(d):String(v))}
function signed(v){return v===null||v===undefined?"-":(v>=0?"+":"")+fmt(v)}
function rgba(hex,a){const n=parseInt(hex.slice(1),16);
  return "rgba("+(n>>16)+","+((n>>8)&255)+","+(n&255)+","+a+")"}
async function api(path){const r=await fetch(path);const j=await r.json();
  if(!r.ok){$("msg").textContent=j.error;throw new Error(j.error)}return j}
// One recipe's curve of `key`: a run's own series (with its bootstrap band), or over several seeds the
// mean at the steps every seed logged, with the min-max over seeds as the band.
function recipeCurve(runs,key){
  if(runs.length===1){const c=curves[runs[0]];const s=c&&c.series[key];
    return s?{line:s,band:c.bands[key]||null}:null}
  const maps=runs.map(id=>{const s=curves[id]&&curves[id].series[key];const m=new Map();
    if(s)s.step.forEach((st,i)=>m.set(st,[s.y[i],s.tokens[i],s.wall[i]]));return m});
  if(maps.some(m=>!m.size))return null;
  const steps=[...maps[0].keys()].filter(st=>maps.every(m=>m.has(st))).sort((a,b)=>a-b);
  const line={step:steps,tokens:[],wall:[],y:[]},band={step:steps,tokens:[],wall:[],low:[],high:[]};
  const mean=xs=>xs.reduce((a,b)=>a+b,0)/xs.length;
  for(const st of steps){const v=maps.map(m=>m.get(st)),ys=v.map(x=>x[0]);
    line.y.push(mean(ys));band.low.push(Math.min(...ys));band.high.push(Math.max(...ys));
    for(const [f,k] of [["tokens",1],["wall",2]]){const x=mean(v.map(t=>t[k]));
      line[f].push(x);band[f].push(x)}}
  return {line:line,band:band}}
function render(){const box=$("panels");const jobs=[];
  for(const [pid,title,key] of PANELS){const tr=[];
    doc.runs.forEach((r,i)=>{const c=recipeCurve(r.runs,key);if(!c)return;const col=COLORS[i%COLORS.length];
      const name=r.runs.length>1?r.id+" ("+r.runs.length+" seeds)":r.id,b=c.band,s=c.line;
      if(b)tr.push({x:b[xaxis].concat([...b[xaxis]].reverse()),y:b.high.concat([...b.low].reverse()),
        type:"scatter",mode:"lines",fill:"toself",fillcolor:rgba(col,0.15),line:{width:0},hoverinfo:"skip",
        showlegend:false});
      tr.push({x:s[xaxis],y:s.y,customdata:s.step,name:name,meta:r.id,type:"scatter",
        mode:s.y.length>120?"lines":"lines+markers",line:{color:col,width:1.5},marker:{size:4},
        hovertemplate:name+"<br>step %{customdata}<br>%{y:.4g}<extra></extra>"})});
    if(!tr.length)continue;
    let div=$("cmp-"+pid);
    if(!div){div=document.createElement("div");div.id="cmp-"+pid;div.className="plot panel";
      box.appendChild(div)}
    const shapes=xaxis==="tokens"?[{type:"line",xref:"x",yref:"paper",x0:doc.budget_tokens,
      x1:doc.budget_tokens,y0:0,y1:1,line:{color:"#555",dash:"dash",width:1}}]:[];
    const band=pid.startsWith("heldout")?" (band: 95% bootstrap; seeds: min-max)":
      " (band: min-max over seeds)";
    jobs.push(Plotly.react(div,tr,{title:{text:title+band,font:{size:13},x:0.02},
      margin:{l:55,r:15,t:34,b:38},hovermode:"closest",xaxis:{title:{text:XLABEL[xaxis],font:{size:11}}},
      shapes:shapes,legend:{font:{size:10}},uirevision:xaxis},{displaylogo:false,responsive:true}))}
  return Promise.all(jobs)}
function row(r){const tr=document.createElement("tr");tr.className="cmprow";
  let acc="-";
  if(r.runs.length===1)acc=r.step===null?"-":fmt(r.accuracy)+" @ step "+r.step;
  else acc=fmt(r.accuracy)+" (mean of "+Object.keys(r.accuracies).length+" seeds: "+
    Object.values(r.accuracies).map(a=>fmt(a)).join(", ")+") @ steps "+r.steps.map(s=>fmt(s,0)).join(", ");
  const d=r.difference,t=r.t_interval;let diff="(baseline)";
  if(r.id!==doc.baseline){diff=d?signed(d.estimate)+" ["+signed(d.low)+", "+signed(d.high)+"] over "+d.n+
      " problems"+(d.seeds>1?" x "+d.seeds+" seeds pooled":""):(r.difference_why||"-");
    if(t)diff+="; over seeds "+signed(t.mean)+" ["+signed(t.low)+", "+signed(t.high)+"] ("+t.method+")"}
  const runs=r.runs.length>1||r.runs[0]!==r.id?" ("+r.runs.join(", ")+")":"";
  for(const text of [r.id+(r.name?" "+r.name:"")+runs,fmt(r.total_tokens,0),acc,diff]){
    const td=document.createElement("td");td.textContent=text;tr.appendChild(td)}
  return tr}
async function load(){try{
    doc=await api("/api/compare?runs="+ids.map(encodeURIComponent).join(","));
    $("what").textContent=doc.runs.length+" recipes ("+ids.length+" runs) at an equal budget of "+
      fmt(doc.budget_tokens,0)+" generated tokens";
    $("blocking").textContent=doc.blocking.length?"posttrain compare would refuse these runs: "+
      doc.blocking.join("; "):"";
    const body=document.querySelector("#cmp tbody");body.innerHTML="";
    for(const r of doc.runs)body.appendChild(row(r));
    const keys=Object.keys(doc.config_differences);
    $("diffkeys").textContent=keys.length?"config keys that differ: "+keys.join(", "):"";
    const all=doc.runs.flatMap(r=>r.runs);
    await Promise.all(all.map(async id=>{
      curves[id]=await api("/run/"+encodeURIComponent(id)+"/api/curves?full=1")}));
    await render();window.__posttrain.ready=true
  }catch(e){$("msg").textContent=$("msg").textContent||String(e)}}
$("xaxis").onchange=e=>{xaxis=e.target.value;render().catch(()=>{})};
if(typeof Plotly==="undefined"){
  $("msg").textContent="plotly.js did not load: install the plot extra (pip install 'posttrain[plot]')"}
else load();
</script></body></html>
"""
