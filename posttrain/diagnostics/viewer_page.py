"""The trajectory viewer page of ``posttrain view`` (vanilla JS over the JSON endpoints, no assets).

``?step=N`` opens step N (the nearest step with trajectories, saying so, when N has none): a click on
a curve of the run page lands here. A step's groups come one page (50) at a time from ``api/step``
(``offset``/``limit``); the "more groups" button appends the next page, so a 100k-trajectory step stays fast.
"""

from __future__ import annotations

PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain view</title><link rel="icon" href="data:,">
<style>
body{font-family:sans-serif;margin:0;font-size:13px}
header{background:#223;color:#eee;padding:6px 12px}
#main{display:grid;grid-template-columns:150px 420px 1fr;height:calc(100vh - 190px)}
#main>div{overflow:auto;border-right:1px solid #ccc;padding:6px}
.step,.traj{cursor:pointer;padding:2px 4px;border-radius:3px}
.step:hover,.traj:hover{background:#eef}.sel{background:#cde!important}
.group{margin-bottom:8px;border-bottom:1px dashed #ccc}.ghead{font-weight:bold;color:#334}
.correct{color:#070}.wrong{color:#a00}.invalid{color:#a60}.timeout,.env_failure,.infra_error{color:#707}
#filters{padding:6px 12px;background:#f4f4f4;border-bottom:1px solid #ccc}
#filters input{width:60px}#f-status{width:150px!important}
.tok{font-family:monospace;font-size:15px;white-space:pre;border-right:1px solid #fff;padding:1px 0}
.prompt{color:#888;background:#f2f2f2}
#flagged{height:110px;overflow:auto;padding:6px 12px;border-top:2px solid #223}
#legend{color:#555;margin:4px 0}
</style></head><body>
<header><a id="back" href="../" style="color:#9cf" hidden>curves</a>
 posttrain view: <span id="run"></span> <span id="toksrc" style="color:#aab"></span>
 <button id="refresh">refresh steps</button></header>
<div id="filters">status <input id="f-status" placeholder="correct,wrong">
 lag <input id="f-lag-min"> - <input id="f-lag-max">
 reward <input id="f-reward-min"> - <input id="f-reward-max">
 length <input id="f-len-min"> - <input id="f-len-max">
 <button id="apply">apply</button> <span id="count"></span> <span id="error" style="color:#a00"></span></div>
<div id="main"><div id="steps"></div><div id="groups"></div>
<div id="detail"><p>Pick a step, then a trajectory.</p></div></div>
<div id="flagged"></div>
<script>
let curStep=null, curTraj=null, colour="advantage";
if(location.pathname.endsWith("/traj/"))document.getElementById("back").hidden=false;
const $=id=>document.getElementById(id);
// api() already shows a failed request in #error: no uncaught rejection on top of it
const quiet=p=>p.catch(()=>{});
async function api(path){const r=await fetch(path);const j=await r.json();
  if(!r.ok){$("error").textContent=j.error;throw new Error(j.error)} $("error").textContent="";return j}
function fmt(v,d=3){return v===null||v===undefined?"-":(typeof v==="number"?v.toFixed(d):v)}
async function loadSteps(){const j=await api("api/steps");$("run").textContent=j.run_dir;$("toksrc").textContent="("+j.tokens+")";
  const box=$("steps");box.innerHTML="";
  for(const s of j.steps){const d=document.createElement("div");d.className="step"+(s.step===curStep?" sel":"");
    d.id="step-"+s.step;d.textContent="step "+s.step+" ("+s.n+", r="+fmt(s.reward_mean,2)+")";
    d.onclick=()=>quiet(loadStep(s.step));box.appendChild(d)}
  const want=new URLSearchParams(location.search).get("step");
  if(want!==null&&curStep===null&&j.steps.length){const n=parseInt(want,10),have=j.steps.map(s=>s.step);
    const near=have.reduce((a,b)=>Math.abs(b-n)<Math.abs(a-n)?b:a);
    await loadStep(near);  // a curve point of a step without trajectories (e.g. the step-0 evaluation)
    if(near!==n)$("error").textContent="step "+want+" has no trajectories in the ledger; showing step "+near;
    document.getElementById("step-"+near).scrollIntoView({block:"nearest"})}}
function query(){const q=new URLSearchParams({step:curStep});
  for(const k of ["status","lag-min","lag-max","reward-min","reward-max","len-min","len-max"]){
    const v=$("f-"+k).value.trim();if(v)q.set(k.replace("-","_"),v)}return q}
// One page of groups at a time (a step can hold 100k trajectories): "more groups" fetches the next page.
let nextOffset=null,loaded=0;
async function loadStep(step){curStep=step;
  document.querySelectorAll(".step").forEach(e=>e.classList.toggle("sel",e.id==="step-"+step));
  const j=await api("api/step?"+query());$("count").textContent=j.shown+" of "+j.total+" trajectories"+
    (j.shown<j.total?" pass the filters":"")+", in "+j.groups_total+" groups";
  $("groups").innerHTML="";loaded=0;addGroups(j)}
async function loadMore(){if(nextOffset===null)return;const q=query();q.set("offset",nextOffset);
  $("more").disabled=true;addGroups(await api("api/step?"+q).catch(e=>{$("more").disabled=false;throw e}))}
function addGroups(j){const box=$("groups");const old=$("more");if(old)old.remove();
  for(const g of j.groups){const gd=document.createElement("div");gd.className="group";
    gd.innerHTML="<div class='ghead'></div>";gd.firstChild.textContent=g.prompt_id+"  success "+fmt(g.success_rate,2)+" (n="+g.n+")";
    for(const t of g.trajectories){const d=document.createElement("div");d.className="traj";d.dataset.id=t.traj_id;
      d.innerHTML="<span class='"+t.status+"'>"+t.status+"</span> r="+fmt(t.reward,2)+" len="+t.length+" lag="+fmt(t.lag,0)+" adv="+fmt(t.advantage,2);
      d.onclick=()=>quiet(loadTraj(t.traj_id));gd.appendChild(d)}
    box.appendChild(gd)}
  loaded+=j.groups.length;nextOffset=j.next_offset;
  if(nextOffset!==null){const b=document.createElement("button");b.id="more";
    b.textContent="more groups ("+loaded+" of "+j.groups_total+" shown)";b.onclick=()=>quiet(loadMore());box.appendChild(b)}}
function shade(v,scale,signed){if(v===null)return "transparent";const x=Math.min(1,Math.abs(v)/(scale||1));
  if(!signed)return "rgba(200,120,0,"+(0.1+0.8*x)+")";
  return v>=0?"rgba(0,150,60,"+(0.1+0.8*x)+")":"rgba(210,40,40,"+(0.1+0.8*x)+")"}
let detail=null;
async function loadTraj(id){curTraj=id;
  document.querySelectorAll(".traj").forEach(e=>e.classList.toggle("sel",e.dataset.id===id));
  detail=await api("api/traj?"+new URLSearchParams({step:curStep,id:id}));render()}
function render(){const d=detail,box=$("detail");if(!d)return;
  if(!(colour in d.fields))colour=Object.keys(d.fields)[0]||"advantage";
  const s=d.summary;let h="<div><b></b></div><div>status <span class='"+s.status+"'>"+s.status+"</span>, reward "+fmt(s.reward)+
    ", length "+s.length+", lag "+fmt(s.lag,0)+", verifier "+s.verifier+
    (s.hidden_status?", hidden "+s.hidden_verifier+" <span id='hidden-status' class='"+s.hidden_status+"'>"+s.hidden_status+"</span>":"")+
    ", advantage "+fmt(s.advantage)+" <span id='adv-src'>("+s.advantage_source+")</span>, old v"+d.old_version+", ref "+(d.ref_version===null?"none":"v"+d.ref_version)+"</div>";
  h+="<div>colour by <select id='colour'>"+Object.keys(d.fields).map(k=>"<option value='"+k+"'"+(k===colour?" selected":"")+">"+k+"</option>").join("")+"</select></div>";
  h+="<div id='legend'></div><div id='tokens'></div><div id='missing' style='color:#888'></div><pre id='meta'></pre>";
  box.innerHTML=h;box.querySelector("b").textContent=s.traj_id;$("legend").textContent=d.fields[colour]||"";
  $("missing").textContent=Object.keys(d.missing_fields).length?"not in this ledger: "+Object.keys(d.missing_fields).join(", "):"";
  $("meta").textContent=JSON.stringify(d.meta,null,1);
  const vals=d.tokens.map(t=>t[colour]).filter(v=>v!==null);const scale=Math.max(...vals.map(Math.abs),1e-12);
  const signed=colour!=="surprisal";const tk=$("tokens");
  for(const t of d.tokens){const sp=document.createElement("span");sp.className="tok"+(t.action?"":" prompt");
    sp.textContent=t.text;if(t.action)sp.style.background=shade(t[colour],scale,signed);
    sp.title="token "+t.id+" ("+t.role+(t.action?", sampled by v"+t.version:"")+")\nbehaviour "+fmt(t.behavior,4)+"\nold "+fmt(t.old,4)+
      "\nref "+fmt(t.ref,4)+"\ncurrent "+fmt(t.current,4)+"\n"+colour+" "+fmt(t[colour],4);tk.appendChild(sp)}
  $("colour").onchange=e=>{colour=e.target.value;render()}}
async function loadFlagged(){const j=await api("api/flagged");const b=$("flagged");
  b.innerHTML="<b>Passed the training verifier, failed the hidden / second verifier</b> <span id='flag-expl'></span><ol id='flag-list'></ol>";
  $("flag-expl").textContent="- "+j.explanation;
  for(const it of j.items){const li=document.createElement("li");li.className="flagitem";
    li.textContent="step "+it.step+" "+it.traj_id+": "+JSON.stringify(it.response)+" (reference "+JSON.stringify(it.reference)+") -> "+it.second_status+": "+it.second_explanation;
    li.style.cursor="pointer";li.onclick=()=>quiet(loadStep(it.step).then(()=>loadTraj(it.traj_id)));
    $("flag-list").appendChild(li)}}
$("apply").onclick=()=>{if(curStep!==null)quiet(loadStep(curStep))};
$("refresh").onclick=()=>quiet(loadSteps());
quiet(loadSteps());quiet(loadFlagged());
</script></body></html>
"""
